"""Outer search over parallel configurations: enumerate, prune, filter by memory, rank by step time.

Every factorisation ``tp x cp x pp x dp`` of the world is tried with tp tiling a node and dividing
the (kv) heads and the MLP width, pp up to the layer count (stages need not hold equal layers:
``stagesplit`` balances them), cp keeping >= ``MIN_CP_TOKENS`` tokens per rank, then the pipeline
schedule (1F1B and ZB-H1 with one chunk per stage, interleaved 1F1B with ``vpp`` up to
``MAX_VPP`` chunks), micro-batch sizes, recomputation and dp flavour (distributed optimizer or
FSDP); expert models also try the expert mesh (``expert_choices``): every ep dividing the experts
with every etp that divides the node and the expert width under the folded mapping, and the
unfolded mapping (etp = tp, ep inside dp) where it places ranks differently. Pruning happens on
integers before anything is simulated; then a configuration whose pipeline time bound (the mean
stage's, a lower bound of its step that needs no stage split) is slower than the ``top``-th best
so far is dropped, and the memory model runs before the rest of the time model. Ties break on
memory, then on the configuration text, so results are deterministic and equal to an exhaustive
ranking.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from meshfold.sim.footprint import stage_memory
from meshfold.sim.model import ModelSpec
from meshfold.sim.parallel import (
    MOE_MAPPINGS,
    RECOMPUTE,
    SCHEDULES,
    ConfigError,
    ParallelConfig,
    TrainSpec,
    divisors,
)
from meshfold.sim.result import SimResult
from meshfold.sim.simulate import peak_memory, pipeline_lower_bound, simulate
from meshfold.target.hardware import Cluster

MIN_CP_TOKENS = 256
MICRO_BATCHES = (1, 2, 4, 8)
MAX_VPP = 16
MESH_AXES = ("dp", "tp", "cp", "pp", "ep", "etp")
# NOTE: fields the search chooses itself unless pinned; other pins pass through unchanged.
_SEARCHED = (
    "dp",
    "tp",
    "cp",
    "pp",
    "ep",
    "etp",
    "vpp",
    "micro_batch_size",
    "zero",
    "recompute",
    "moe_mapping",
    "schedule",
)


class MeshLike(Protocol):
    """Anything with parallel axis ``names`` and ``sizes`` (e.g. ``ir.Mesh``)."""

    @property
    def names(self) -> tuple[str, ...]: ...

    @property
    def sizes(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class Ranked:
    """One search result: its 1-based ``rank`` and the simulation of ``config``."""

    rank: int
    config: ParallelConfig
    result: SimResult


def _pins(fixed: Mapping[str, Any] | None, mesh: Mapping[str, int] | MeshLike | None) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    pins: dict[str, Any] = dict(fixed or {})
    bad = sorted(set(pins) - fields)
    if bad:
        raise ValueError(f"fixed names unknown ParallelConfig fields {bad}; fields are {sorted(fields)}")
    if mesh is not None:
        axes = dict(mesh) if isinstance(mesh, Mapping) else dict(zip(mesh.names, mesh.sizes, strict=True))
        unknown = sorted(set(axes) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"mesh axes {unknown} are not parallel axes; use {', '.join(MESH_AXES)}")
        for name, size in axes.items():
            if name in pins and pins[name] != size:
                raise ValueError(f"mesh says {name}={size} but fixed says {name}={pins[name]}")
            pins[name] = int(size)
    return pins


def candidates(
    model: ModelSpec,
    cluster: Cluster,
    train: TrainSpec,
    *,
    fixed: Mapping[str, Any] | None = None,
    mesh: Mapping[str, int] | MeshLike | None = None,
) -> Iterator[ParallelConfig]:
    """Every configuration the search considers (valid by construction up to memory), in a
    deterministic order. ``fixed`` pins ParallelConfig fields; ``mesh`` pins axis sizes."""
    pins = _pins(fixed, mesh)
    world, dpn = cluster.world_size, cluster.devices_per_node

    def choose(name: str, options: list[Any]) -> list[Any]:
        return [pins[name]] if name in pins else options

    kv = model.heads if model.is_mla else model.n_kv_heads
    tps = choose(
        "tp",
        [
            t
            for t in divisors(world)
            if dpn % t == 0 and kv % t == 0 and model.heads % t == 0 and model.ffn_hidden % t == 0
        ],
    )
    for tp in tps:
        cps = choose(
            "cp",
            [
                c
                for c in divisors(world // tp)
                if c == 1 or (train.seq_len % (2 * c) == 0 and train.seq_len // c >= MIN_CP_TOKENS)
            ],
        )
        for cp in cps:
            pps = choose("pp", [p for p in divisors(world // (tp * cp)) if p <= model.layers])
            for pp in pps:
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                if "dp" in pins and pins["dp"] != dp:
                    continue
                yield from _inner(model, train, pins, dpn, dp, tp, cp, pp)


def expert_choices(
    model: ModelSpec, pins: Mapping[str, Any], dpn: int, dp: int, tp: int, cp: int, pp: int
) -> list[tuple[int, int | None, str]]:
    """(ep, etp, moe_mapping) candidates for one attention mesh ``tp x cp x dp x pp``.

    Folded: every ep dividing the experts with every etp that divides the node and the expert
    width (etp * ep * pp must divide the world). Unfolded: etp = tp and ep dividing dp; it is
    listed only where it places ranks differently from the folded mapping with etp = tp (cp > 1)
    or when ``moe_mapping`` is pinned. Dense models get ``(1, None, mapping)``."""
    mappings = [pins["moe_mapping"]] if "moe_mapping" in pins else list(MOE_MAPPINGS)
    if not model.num_experts:
        return [(1, None, mappings[0])]
    eps = [pins["ep"]] if "ep" in pins else divisors(model.num_experts)
    etps = [pins["etp"]] if "etp" in pins else [t for t in divisors(dpn) if model.moe_ffn_hidden % t == 0]
    world = dp * tp * cp * pp
    out: list[tuple[int, int | None, str]] = []
    for mapping in mappings:
        for ep in eps:
            if mapping == "folded":
                out += [(ep, t, mapping) for t in etps if world % (ep * t * pp) == 0]
            elif dp % ep == 0 and (cp > 1 or "moe_mapping" in pins) and pins.get("etp", tp) == tp:
                out.append((ep, tp, mapping))
    return out


def _inner(
    model: ModelSpec, train: TrainSpec, pins: dict[str, Any], dpn: int, dp: int, tp: int, cp: int, pp: int
) -> Iterator[ParallelConfig]:
    mbss = [b for b in MICRO_BATCHES if train.global_batch % (dp * b) == 0]
    mbss = [pins["micro_batch_size"]] if "micro_batch_size" in pins else mbss
    vpps = [v for v in range(1, MAX_VPP + 1) if pp * v <= model.layers] if pp > 1 else [1]
    vpps = [pins["vpp"]] if "vpp" in pins else vpps
    zeros = [pins["zero"]] if "zero" in pins else [1, 3]
    recomputes = [pins["recompute"]] if "recompute" in pins else list(RECOMPUTE)
    experts = expert_choices(model, pins, dpn, dp, tp, cp, pp)
    rest = {k: v for k, v in pins.items() if k not in _SEARCHED}
    schedules = [pins["schedule"]] if "schedule" in pins else list(SCHEDULES)
    for mbs, vpp, sched, zero, rc, (ep, etp, mapping) in itertools.product(
        mbss, vpps, schedules, zeros, recomputes, experts
    ):
        m = train.global_batch // (dp * mbs) if train.global_batch % (dp * mbs) == 0 else 0
        if m == 0 or (vpp > 1 and m % pp):
            continue
        if sched != "1f1b" and (pp == 1 or vpp > 1) and "schedule" not in pins:
            continue  # NOTE: ZB-H1 is one chunk per stage; without a pipeline it equals 1F1B
        yield ParallelConfig(
            dp=dp,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=ep,
            etp=etp,
            vpp=vpp,
            micro_batch_size=mbs,
            zero=zero,
            recompute=rc,
            moe_mapping=mapping,
            schedule=sched,
            **rest,
        )


def search_configs(
    model: ModelSpec,
    cluster: Cluster,
    train: TrainSpec,
    *,
    fixed: Mapping[str, Any] | None = None,
    mesh: Mapping[str, int] | MeshLike | None = None,
    top: int = 10,
    progress: Callable[[int], None] | None = None,
) -> list[Ranked]:
    """The ``top`` fastest configurations whose peak memory fits the device, best first.

    ``fixed`` pins ParallelConfig fields (e.g. ``{"tp_comm_overlap": True, "zero": 1}``),
    ``mesh`` pins axis sizes (a mapping such as ``{"tp": 8, "pp": 4}`` or an ``ir.Mesh``).
    Returns an empty list when nothing fits; raises ValueError on unknown pins. Ranking is by
    simulated step time, ties by peak memory then configuration text (deterministic).
    ``progress(n)`` is called with the number of configurations examined, every 1000 of them."""
    if top <= 0:
        return []
    hbm = cluster.device.hbm_bytes
    best: list[tuple[float, float, str, SimResult]] = []
    for n, cfg in enumerate(candidates(model, cluster, train, fixed=fixed, mesh=mesh)):
        if progress is not None and n % 1000 == 0:
            progress(n)
        try:
            cfg.validate(model, cluster, train)
        except ConfigError:
            continue
        # NOTE: exact pruning: the pipeline part never exceeds the step and its bound never exceeds
        # the pipeline part, so a configuration whose bound is slower than the top-th best cannot
        # enter the result.
        if len(best) >= top and pipeline_lower_bound(model, cluster, cfg, train) > best[top - 1][0]:
            continue
        # NOTE: the mean rank's bytes bound the peak from below and need no stage split
        if stage_memory(model, cfg, train).floor() > hbm or peak_memory(model, cluster, cfg, train).total > hbm:
            continue
        res = simulate(model, cluster, cfg, train, timeline=False)
        bisect.insort(best, (res.step_time_s, res.peak_memory_bytes, repr(cfg), res), key=lambda s: s[:3])
        del best[top:]
    return [Ranked(i + 1, s[3].config, s[3]) for i, s in enumerate(best)]
