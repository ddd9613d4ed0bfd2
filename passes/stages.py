"""Pipeline stages: which contiguous layers each stage runs.

One rule for the runtime (``meshfold.pp.pipelined`` splits a captured program at the layers it names)
and the simulator (``passes.cost`` prices the stages it gives): layers ``0..L-1`` with their times
go to ``S`` stages in order, each stage a contiguous run of at least one layer; the first stage also
runs what comes before the layers (the embedding: ``head``), the last what comes after (the final
norm, the output layer and the loss: ``tail``). The split minimises the slowest stage's time (a
pipeline steps at the pace of its slowest stage), so a heavy head or tail leaves its stage fewer
layers, as Llama 3 405B's first and last stages were; among splits as fast, the one whose stages
are most even (least sum of squared stage times), then the one whose earlier stages hold fewer
layers. ``fits(stage, first, end)`` (optional) says whether a stage holding layers
``first..end-1`` fits its device's memory under the schedule (an early 1F1B stage keeps more
microbatches' activations than a late one); splits that do not fit are never chosen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

from meshfold.passes.base import PassError

PP = "pp"
"""The mesh axis pipeline stages are laid along."""
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
"""The schedules ``torch.distributed.pipelining`` runs a pipeline by (``meshfold.pp.pipelined``)."""
AUTO = "auto"
"""``pp={"schedule": "auto"}``: the schedule and stages per rank the time model predicts fastest
(``plan_pipeline``); what ``plan="auto"`` asks for when the pipeline's schedule is not given."""


@dataclass(frozen=True)
class PipelineSpec:
    """How a model is pipelined: ``ranks`` along the ``pp`` axis, the ``schedule``, the ``microbatches``
    one step runs, and the ``virtual`` stages each rank holds (more than one only when looped). A
    ``schedule`` of ``AUTO`` (``virtual`` 0) is one ``plan_pipeline`` has yet to choose."""

    ranks: int
    schedule: str = "1f1b"
    microbatches: int = 0
    virtual: int = 1

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    @property
    def label(self) -> str:
        """The schedule and, when more than one, the stages per rank: ``1f1b``, ``interleaved v2``."""
        return f"{self.schedule} v{self.virtual}" if self.virtual > 1 else self.schedule

    @staticmethod
    def of(spec: Mapping[str, Any] | PipelineSpec | None, ranks: int) -> PipelineSpec:
        """Read ``parallelize(pp={"schedule": ..., "microbatches": ..., "virtual": ...})``."""
        if isinstance(spec, PipelineSpec):
            return dataclasses.replace(spec, ranks=ranks)
        given = dict(spec or {})
        unknown = set(given) - {"schedule", "microbatches", "virtual"}
        if unknown:
            raise PassError(f"pp= takes schedule, microbatches and virtual; not {', '.join(sorted(unknown))}")
        schedule = str(given.get("schedule", "1f1b"))
        if schedule not in (*SCHEDULES, AUTO):
            raise PassError(f"pp schedule {schedule!r} is not one of {', '.join(SCHEDULES)} or {AUTO}")
        micro = int(given.get("microbatches", ranks))
        if micro < 1:
            raise PassError(f"pp microbatches={micro}: a step runs at least one microbatch")
        if schedule == AUTO:
            if "virtual" in given:
                raise PassError("pp schedule auto chooses the stages per rank too; give a schedule with virtual=")
            return PipelineSpec(ranks, AUTO, micro, 0)
        looped = schedule in ("interleaved", "zero-bubble")
        virtual = int(given.get("virtual", 2 if schedule == "interleaved" else 1))
        if virtual < 1 or (virtual > 1 and not looped):
            raise PassError(
                f"pp virtual={virtual}: only the interleaved and zero-bubble schedules run several stages per rank "
                "(virtual >= 2); the others run one"
            )
        if looped and micro % ranks:
            raise PassError(
                f"pp microbatches={micro}: the {schedule} schedule runs microbatches in rounds of the {ranks} "
                f"pipeline ranks; give a multiple of {ranks}"
            )
        return PipelineSpec(ranks, schedule, micro, virtual)

    def in_flight(self, stage: int) -> int:
        """Microbatches whose activations ``stage`` holds at once under the schedule: all of them
        under GPipe; under 1F1B the stages still to run their forward before its first backward
        (``p - s``), and about that over the looped stages of interleaved schedules."""
        if self.schedule == "gpipe":
            return self.microbatches
        return min(self.microbatches, self.stages - stage)

    def bubble(self) -> float:
        """The share of a step a rank idles under this schedule with every stage equally fast and
        communication free: ``(p - 1) / (v m + p - 1)`` for ``p`` ranks, ``m`` microbatches and ``v``
        stages per rank (GPipe and 1F1B alike; interleaving divides the ramp by ``v``). Zero bubble
        (ZB-H1's analysis, a forward, an input-gradient and a weight-gradient step taking equal time):
        the weights' steps fill two thirds of the ramp, ``(p - 1) / (3 v m + p - 1)``."""
        p, m, v = self.ranks, self.microbatches, self.virtual
        work = 3 * v * m if self.schedule == "zero-bubble" else v * m
        return (p - 1) / (work + p - 1)

    def held(self, rank: int) -> list[int]:
        """The stages pipeline rank ``rank`` runs (looping: ``rank, rank + ranks, ...``)."""
        return list(range(rank, self.stages, self.ranks))


Fits = Callable[[int, int, int], bool]


class SplitError(ValueError):
    """No split of the layers into the stages asked for (too few layers, or none fits memory)."""


@dataclass(frozen=True)
class StageSplit:
    """The layers of each stage: stage ``s`` runs layers ``bounds[s]..bounds[s+1]-1``."""

    bounds: tuple[int, ...]
    times: tuple[float, ...]
    """Each stage's time (its layers', plus the head's on the first and the tail's on the last)."""

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in pairwise(self.bounds))

    @property
    def slowest(self) -> float:
        return max(self.times)

    def stage_of(self, layer: int) -> int:
        """The stage that runs ``layer``."""
        for s in range(len(self.bounds) - 1):
            if layer < self.bounds[s + 1]:
                return s
        raise IndexError(f"layer {layer} is past the last stage's layers (0..{self.bounds[-1] - 1})")

    def describe(self) -> str:
        """``4 stages: layers 0-6 | 7-14 | 15-22 | 23-29 (layers 7, 8, 8, 7; slowest 1.02x the mean)``"""
        spans = " | ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in pairwise(self.bounds))
        mean = sum(self.times) / len(self.times)
        even = f"; slowest {self.slowest / mean:.2f}x the mean" if mean > 0 else ""
        counts = ", ".join(map(str, self.counts))
        return f"{len(self.times)} stages: layers {spans} (layers {counts}{even})"


def split_layers(
    times: Sequence[float],
    stages: int,
    *,
    head: float = 0.0,
    tail: float = 0.0,
    fits: Fits | None = None,
) -> StageSplit:
    """The split of layers with ``times`` into ``stages`` contiguous stages (see the module docstring)."""
    n = len(times)
    if stages < 1:
        raise SplitError(f"a pipeline needs at least one stage, got {stages}")
    if n < stages:
        raise SplitError(f"{n} layers cannot fill {stages} pipeline stages (each stage runs at least one layer)")
    pre = [0.0, *accumulate(times)]

    def stage_time(s: int, a: int, b: int) -> float:
        return pre[b] - pre[a] + (head if s == 0 else 0.0) + (tail if s == stages - 1 else 0.0)

    # NOTE: pruning that never changes the answer (times are >= 0): no stage of the answer is
    # slower than the slowest stage of any split that fits (``cap``, from equal layer counts when
    # they fit), and a stage only gets slower as it starts earlier, so candidates past either
    # bound (with a margin over ``_better``'s rounding tolerance) are never looked at.
    cap = _fitting_slowest(n, stages, stage_time, fits) * (1.0 + 2e-9)
    # NOTE: best[s][b]: (slowest, sum of squares, bounds) of stages 0..s holding layers 0..b-1
    inf: tuple[float, float, tuple[int, ...]] = (float("inf"), float("inf"), ())
    best: list[list[tuple[float, float, tuple[int, ...]]]] = [[inf] * (n + 1) for _ in range(stages)]
    for b in range(1, n - stages + 2):
        t = stage_time(0, 0, b)
        if t > cap:
            break
        if fits is None or fits(0, 0, b):
            best[0][b] = (t, t * t, (0, b))
    for s in range(1, stages):
        rest = stages - s - 1
        last = tail if s == stages - 1 else 0.0  # NOTE: stage_time's terms, in its order
        for b in range(s + 1, n - rest + 1):
            if pre[b] + head > (s + 1) * cap or (rest and pre[n] - pre[b] + tail > rest * cap):
                continue  # NOTE: some stage of this prefix or of the rest must be slower than cap
            found = inf
            for a in range(b - 1, s - 1, -1):
                t = pre[b] - pre[a] + 0.0 + last
                if t > cap or (found[2] and t * (1.0 - 2e-9) > found[0]):
                    break
                slowest, squares, bounds = best[s - 1][a]
                if not bounds or (fits is not None and not fits(s, a, b)):
                    continue
                cand = (max(slowest, t), squares + t * t, (*bounds, b))
                if _better(cand, found):
                    found = cand
            best[s][b] = found
    slowest, _, bounds = best[stages - 1][n]
    if not bounds:
        raise SplitError(f"no split of {n} layers into {stages} stages fits each stage's memory")
    return StageSplit(bounds, tuple(stage_time(s, a, b) for s, (a, b) in enumerate(pairwise(bounds))))


def _fitting_slowest(n: int, stages: int, stage_time: Callable[[int, int, int], float], fits: Fits | None) -> float:
    """The slowest stage of some split that fits (infinity when none is found), an upper bound of
    the answer's: the better of equal layer counts and of the greedy splits (each stage as many
    layers as fit under a time limit) found by bisecting the limit. Every split it counts is
    checked stage by stage, so the bound holds whatever ``fits`` says."""
    bounds = [k * n // stages for k in range(stages + 1)]
    found = float("inf")
    if fits is None or all(fits(s, a, b) for s, (a, b) in enumerate(pairwise(bounds))):
        found = max(stage_time(s, a, b) for s, (a, b) in enumerate(pairwise(bounds)))
    lo, hi = 0.0, found if found < float("inf") else stage_time(0, 0, n) + stage_time(stages - 1, n, n)
    first = _greedy_slowest(n, stages, stage_time, fits, hi)
    if first is None:
        return found  # NOTE: the greedy split fits nowhere under the loosest limit; keep what there is
    found = min(found, first)
    # NOTE: any split's slowest stage bounds the answer; a closer bound only prunes more
    for _ in range(20):
        if hi - lo <= 1e-3 * hi:
            break
        limit = (lo + hi) / 2
        slowest = _greedy_slowest(n, stages, stage_time, fits, limit)
        if slowest is None:
            lo = limit
        else:
            hi, found = limit, min(found, slowest)
    return found


def _greedy_slowest(
    n: int, stages: int, stage_time: Callable[[int, int, int], float], fits: Fits | None, limit: float
) -> float | None:
    """The slowest stage of the split whose stages each take the most layers that fit within
    ``limit`` seconds (leaving one per later stage), or None when that split does not cover the
    layers within the limit."""
    a, slowest = 0, 0.0
    for s in range(stages):
        last = n - (stages - s - 1)
        end = None
        b = n if s == stages - 1 else a + 1
        while b <= last and stage_time(s, a, b) <= limit:
            if fits is None or fits(s, a, b):
                end = b
            b += 1
        if end is None:
            return None
        slowest, a = max(slowest, stage_time(s, a, end)), end
    return slowest


def _better(a: tuple[float, float, tuple[int, ...]], b: tuple[float, float, tuple[int, ...]]) -> bool:
    """Slower stages lose; then less even ones (up to rounding); then later boundaries (fewer layers early)."""
    if not b[2]:
        return bool(a[2])
    tol = 1e-9 * max(abs(a[0]), abs(b[0]), 1e-30)
    if abs(a[0] - b[0]) > tol:
        return a[0] < b[0]
    tol2 = 1e-9 * max(abs(a[1]), abs(b[1]), 1e-30)
    if abs(a[1] - b[1]) > tol2:
        return a[1] < b[1]
    return a[2] < b[2]


def even_split(layers: int, stages: int) -> StageSplit:
    """Equal layers per stage where they divide, else one more on the later stages (unit times)."""
    return split_layers([1.0] * layers, stages)


def stage_sums(per_layer: Sequence[float], bounds: Sequence[int], head: float, tail: float) -> tuple[float, ...]:
    """Each stage's sum of ``per_layer`` over its layers (``bounds`` as ``StageSplit.bounds``), with
    ``head`` on the first stage and ``tail`` on the last."""
    last = len(bounds) - 2
    return tuple(
        sum(per_layer[a:b]) + (head if s == 0 else 0.0) + (tail if s == last else 0.0)
        for s, (a, b) in enumerate(pairwise(bounds))
    )


def ramp_s(ranks: int, virtual: int, slowest: float, slowest_wgrad: float = 0.0, zero_bubble: bool = False) -> float:
    """Seconds a pipeline's slowest rank idles filling and draining: ``(ranks - 1) / virtual`` of its
    passes (``slowest`` seconds of forward and backward per microbatch over all its stages; with
    ``virtual`` stages a rank, each pass of the ramp is one of them). A zero-bubble schedule (Qi et
    al. 2023, ZB-H1) runs the cool-down's weight-gradient work (``slowest_wgrad`` of it) in the
    ramp, so only the forward and input-gradient part stays idle. The simulator's bubble and the
    runtime's choice of schedule both price it so."""
    passes = (ranks - 1) / virtual
    return passes * (slowest - slowest_wgrad if zero_bubble else slowest)


def pipeline_step_s(
    split: StageSplit, wgrad: Sequence[float], ranks: int, microbatches: int, *, zero_bubble: bool, send_s: float
) -> float:
    """Predicted seconds of one pipelined step of ``split``'s stages (stage ``s`` on rank ``s % ranks``,
    ``wgrad[s]`` of its time weight-gradient work): ``microbatches`` passes of the busiest rank, each
    with its ``2 x virtual`` activation and gradient sends of ``send_s`` (sent between passes, not
    under them), plus the ramp (``ramp_s``) and the sends across the ``stages - 1`` boundaries that
    fill and drain it."""
    stages = len(split.times)
    virtual = stages // ranks
    per_rank = [sum(split.times[r::ranks]) for r in range(ranks)]
    busiest = max(range(ranks), key=per_rank.__getitem__)
    w = sum(wgrad[busiest::ranks])
    sends = 2 * virtual * send_s if stages > 1 else 0.0
    ramp = ramp_s(ranks, virtual, per_rank[busiest], w, zero_bubble)
    return microbatches * (per_rank[busiest] + sends) + ramp + 2 * (stages - 1) * send_s
