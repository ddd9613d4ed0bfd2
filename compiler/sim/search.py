"""Outer search over parallel configurations: enumerate, prune, filter by memory, rank by step time.

Every factorisation ``tp x cp x pp x dp`` of the world is tried with tp tiling a node and dividing
the (kv) heads and the MLP width, pp up to the layer count (stages need not hold equal layers:
``stagesplit`` balances them), cp keeping >= ``MIN_CP_TOKENS`` tokens per rank, then the pipeline
schedule (1F1B and ZB-H1 with one chunk per stage, interleaved 1F1B with ``vpp`` up to
``MAX_VPP`` chunks), micro-batch sizes, recomputation and dp flavour (distributed optimizer or
FSDP); expert models also try the expert mesh (``expert_choices``): every ep dividing the experts
with every etp that divides the node and the expert width under the folded mapping, and the
unfolded mapping (etp = tp, ep inside dp) where it places ranks differently. Pruning happens on
integers before anything is costed; then the search goes best first on lower bounds of the step
that need no stage split (``search_configs``; docs/simulator.md), splits stages and simulates
only what may still enter the ``top`` fastest, and stops at the first bound slower than the
``top``-th best. Ties break on memory, then on the configuration text, so results are
deterministic and equal to an exhaustive ranking.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
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
from meshfold.sim.simulate import Floors, PipelineFloor, peak_memory, simulate, step_lower_bound
from meshfold.target.hardware import Cluster

MIN_CP_TOKENS = 256
MICRO_BATCHES = (1, 2, 4, 8)
MAX_VPP = 16
MESH_AXES = ("dp", "tp", "cp", "pp", "ep", "etp")
_SLACK = 1e-9  # NOTE: relative margin of the pruning for rounding in the bounds
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


def _beaten(bound: float, best: list[tuple[float, float, str, SimResult]], top: int) -> bool:
    """Whether a configuration whose step is at least ``bound`` cannot enter the ``top`` fastest
    of ``best`` (sorted; with a margin for rounding in the bounds)."""
    return len(best) >= top and bound > best[top - 1][0] * (1 + _SLACK)


def _schedules(group: _Group) -> set[tuple[int, str]]:
    """The (vpp, schedule) pairs of ``group``'s members."""
    return {(v, s) for v, s, _ in group.members}


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
    for group in _groups(model, cluster, train, _pins(fixed, mesh)):
        yield from group.configs()


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


@dataclass(frozen=True, slots=True)
class _Group:
    """Configurations that differ only in ``vpp``, ``schedule`` and ``zero`` (``members``, each
    ``(vpp, schedule, zero)``; ``fields`` holds the rest): they share a ``PipelineFloor``."""

    fields: dict[str, Any]
    members: tuple[tuple[int, str, int], ...]

    def configs(self) -> Iterator[ParallelConfig]:
        """The members as configurations, in order."""
        for vpp, schedule, zero in self.members:
            yield ParallelConfig(**self.fields, vpp=vpp, schedule=schedule, zero=zero)


def _meshes(model: ModelSpec, cluster: Cluster, train: TrainSpec, pins: dict[str, Any]) -> Iterator[list[_Group]]:
    """The configurations ``candidates`` yields, in the same order, grouped (``_Group``) and the
    groups of one mesh, micro-batch size and recomputation together (they differ in expert layout)."""
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
                yield from _mesh_groups(model, train, pins, dpn, dp, tp, cp, pp)


def _groups(model: ModelSpec, cluster: Cluster, train: TrainSpec, pins: dict[str, Any]) -> Iterator[_Group]:
    """The groups of ``_meshes``, one after another."""
    for mesh in _meshes(model, cluster, train, pins):
        yield from mesh


def _mesh_groups(
    model: ModelSpec, train: TrainSpec, pins: dict[str, Any], dpn: int, dp: int, tp: int, cp: int, pp: int
) -> Iterator[list[_Group]]:
    mbss = [b for b in MICRO_BATCHES if train.global_batch % (dp * b) == 0]
    mbss = [pins["micro_batch_size"]] if "micro_batch_size" in pins else mbss
    vpps = [v for v in range(1, MAX_VPP + 1) if pp * v <= model.layers] if pp > 1 else [1]
    vpps = [pins["vpp"]] if "vpp" in pins else vpps
    zeros = [pins["zero"]] if "zero" in pins else [1, 3]
    recomputes = [pins["recompute"]] if "recompute" in pins else list(RECOMPUTE)
    experts = expert_choices(model, pins, dpn, dp, tp, cp, pp)
    rest = {k: v for k, v in pins.items() if k not in _SEARCHED}
    schedules = [pins["schedule"]] if "schedule" in pins else list(SCHEDULES)
    for mbs, rc in itertools.product(mbss, recomputes):
        m = train.global_batch // (dp * mbs) if train.global_batch % (dp * mbs) == 0 else 0
        if m == 0:
            continue
        members = tuple(
            (vpp, sched, zero)
            for vpp, sched, zero in itertools.product(vpps, schedules, zeros)
            if not (vpp > 1 and m % pp)
            # NOTE: ZB-H1 is one chunk per stage; without a pipeline it equals 1F1B
            and not (sched != "1f1b" and (pp == 1 or vpp > 1) and "schedule" not in pins)
        )
        if members:
            fields = dict(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch_size=mbs, recompute=rc)
            yield [
                _Group({**fields, "ep": ep, "etp": etp, "moe_mapping": mapping, **rest}, members)
                for ep, etp, mapping in experts
            ]


def _first_valid(model: ModelSpec, cluster: Cluster, train: TrainSpec, group: _Group) -> ParallelConfig | None:
    """The first member of ``group`` that validates (None when none does)."""
    for cfg in group.configs():
        try:
            cfg.validate(model, cluster, train)
        except ConfigError:
            continue
        return cfg
    return None


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
    ``progress(n)`` is called with the number of configurations bounded so far, every 1000 of them."""
    if top <= 0:
        return []
    hbm = cluster.device.hbm_bytes
    # NOTE: best first, on a heap of meshes (bounded with every MoE layer at its fastest expert
    # layout), their groups (by their pipeline floor) and the groups' configurations (by their
    # step bound), each bound below everything its entry stands for; the search ends at the first
    # entry slower than the top-th best (with a margin for rounding), as no entry left is faster.
    heap: list[tuple[float, tuple[int, int, int], PipelineFloor, list[_Group] | _Group | ParallelConfig]] = []
    bounded, floors = 0, Floors(model, cluster, train)
    for i, groups in enumerate(_meshes(model, cluster, train, _pins(fixed, mesh))):
        size = len(groups) * len(groups[0].members)
        if progress is not None and (i == 0 or bounded // 1000 < (bounded + size) // 1000):
            progress(bounded)
        bounded += size
        rep = next((c for c in (_first_valid(model, cluster, train, g) for g in groups) if c is not None), None)
        if rep is None:
            continue
        floor = floors.layouts(rep, {(g.fields["ep"], g.fields["etp"] or rep.tp) for g in groups})
        heap.append((floor.least(_schedules(groups[0])), (i, -1, -1), floor, groups))
    heapq.heapify(heap)
    best: list[tuple[float, float, str, SimResult]] = []
    while heap and not _beaten(heap[0][0], best, top):
        _, (i, j, _), floor, item = heapq.heappop(heap)
        if isinstance(item, list):
            for j, group in enumerate(item):
                cfg = _first_valid(model, cluster, train, group)
                if cfg is not None:
                    fine = floors(cfg)
                    heapq.heappush(heap, (fine.least(_schedules(group)), (i, j, -1), fine, group))
        elif isinstance(item, _Group):
            for k, cfg in enumerate(item.configs()):
                try:
                    cfg.validate(model, cluster, train)
                except ConfigError:
                    continue
                bound = step_lower_bound(model, cluster, cfg, train, floor)
                # NOTE: the mean rank's bytes bound the peak from below and need no stage split
                if not _beaten(bound, best, top) and stage_memory(model, cfg, train).floor() <= hbm:
                    heapq.heappush(heap, (bound, (i, j, k), floor, cfg))
        elif peak_memory(model, cluster, item, train).total <= hbm:
            res = simulate(model, cluster, item, train, timeline=False)
            bisect.insort(best, (res.step_time_s, res.peak_memory_bytes, repr(item), res), key=lambda s: s[:3])
            del best[top:]
    return [Ranked(i + 1, s[3].config, s[3]) for i, s in enumerate(best)]
