"""Plans: presets (``ddp``, ``fsdp``, ``tp`` and ``+`` combinations) and user plans, resolved into
per-input layouts — the seeds that propagation starts from.

A parameter has two layouts: where it is stored (and where its gradient must land) and where it
is computed with. They differ only on fsdp axes: stored ``S(d)``, computed ``R`` (all-gathered
before use, the gradient reduce-scattered back).
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from meshfold.ir import Graph, Layout, Mesh, Placement, R, Shard, TensorType, parse_placement
from meshfold.ir.symbolic import Dim
from meshfold.passes.base import PassError
from meshfold.passes.sharding.tp import megatron_roles

PRESETS = ("ddp", "fsdp", "tp", "cp")
AUTO = "auto"
"""The plan that lets the sharding solve choose every parameter's and input's layout too."""
DATA_AXES = ("dp", "fsdp")


@dataclass(frozen=True)
class Plan:
    """A named preset (``"fsdp+tp"``) plus user overrides: FQN glob → ``{axis: "S(d)" | "R" | "P"}``."""

    preset: str = "ddp"
    overrides: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    pinned: tuple[str, ...] = ()
    """FQNs computed with exactly their planned layout at every use (never gathered or moved):
    expert weights under ``moe=``, split by expert wherever they are used."""

    @staticmethod
    def of(preset: str = "ddp", user: Mapping[str, Mapping[str, str]] | None = None) -> Plan:
        items = tuple((glob, tuple(sorted(axes.items()))) for glob, axes in (user or {}).items())
        return Plan(preset, items)

    def parts(self) -> list[str]:
        if self.preset == AUTO:
            if self.overrides:
                raise PassError("plan='auto' chooses every layout itself; it takes no per-parameter overrides")
            return [AUTO]
        parts = [p.strip() for p in self.preset.split("+") if p.strip()]
        for p in parts:
            if p not in PRESETS:
                known = ", ".join(PRESETS)
                raise PassError(f"unknown plan preset {p!r} in {self.preset!r}; presets: {known}, or 'auto'")
        if not parts:
            raise PassError("empty plan; use e.g. plan='fsdp+tp'")
        return parts


def default_preset(mesh: Mesh) -> str:
    """The preset named by the mesh's axes: ``tp`` on ``tp``, ``cp`` on ``cp``; ``dp`` is fsdp, or ddp
    when the mesh also has an ``fsdp`` axis (HSDP)."""
    by_axis = {"dp": "ddp" if "fsdp" in mesh.names else "fsdp", "fsdp": "fsdp", "tp": "tp", "cp": "cp"}
    unknown = [a for a in mesh.names if a not in by_axis]
    if unknown:
        raise PassError(
            f"cannot infer a plan for mesh axes {unknown} of {mesh}; name axes dp, fsdp, tp or cp, or pass a plan"
        )
    return "+".join(by_axis[a] for a in mesh.names)


def effective_plan(plan: Plan | None, mesh: Mesh) -> Plan:
    """The plan a compilation for ``mesh`` follows: ``plan``, or when none is given the preset the
    mesh's axis names imply (``default_preset``). ``parallelize``, ``pass-debug``, ``meshfold demo``
    and the passes all default through here."""
    return plan if plan is not None else Plan.of(default_preset(mesh))


def mesh_presets(mesh: Mesh) -> list[str]:
    """Every preset the mesh's axis names allow, ``default_preset``'s first: a ``dp`` axis is fsdp or
    ddp (ddp alone beside an ``fsdp`` axis), ``fsdp`` is fsdp, ``tp`` is tp, ``cp`` is cp; none for
    other names."""
    try:
        first = default_preset(mesh)
    except PassError:
        return []
    options = {
        "dp": ("ddp",) if "fsdp" in mesh.names else ("fsdp", "ddp"),
        "fsdp": ("fsdp",),
        "tp": ("tp",),
        "cp": ("cp",),
    }
    names = [""]
    for a in mesh.names:
        names = [f"{n}+{o}" if n else o for n in names for o in options[a]]
    return [first, *(n for n in names if n != first)]


@dataclass(frozen=True)
class Seeds:
    """Resolved plan: storage and compute layouts per input name, and the axes' roles."""

    storage: dict[str, Layout] = field(default_factory=dict)
    compute: dict[str, Layout] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    unsplit: list[str] = field(default_factory=list)
    """One line per parameter the preset meant to split but could not (the sizes do not divide)."""
    whole: tuple[str, ...] = ()
    """Data-parallel axes this call's batch does not divide over, so every rank of them computes the
    whole of its part of the batch (``batch_split``)."""

    def batch_axes(self) -> frozenset[str]:
        """The axes the batch stays split on (``Problem.batch_axes``): the data-parallel ones
        (``data_parallel_axes``) but those this batch does not divide over."""
        return frozenset(data_parallel_axes(self.roles)) - set(self.whole)


def axis_roles(plan: Plan, mesh: Mesh) -> dict[str, str]:
    """Mesh axis → preset using it. ``ddp`` takes ``dp``; ``fsdp`` takes ``fsdp`` if the mesh has one,
    else ``dp``; ``tp`` takes ``tp``; ``cp`` takes ``cp``. Every mesh axis must be used."""
    roles: dict[str, str] = {}
    parts = plan.parts()
    if parts == [AUTO]:
        return {a: AUTO for a in mesh.names}
    for p in parts:
        if p in ("tp", "cp"):
            axis = p
        elif p == "fsdp":
            axis = "fsdp" if "fsdp" in mesh.names else "dp"
        else:
            axis = "dp"
        if axis not in mesh.names:
            raise PassError(
                f"plan {plan.preset!r} puts {p} on a mesh axis named {axis!r}, but {mesh} has axes "
                f"{list(mesh.names)}; name the mesh dims (mesh_dim_names=...) accordingly"
            )
        if axis in roles:
            raise PassError(f"plan {plan.preset!r} puts both {roles[axis]} and {p} on mesh axis {axis!r}")
        roles[axis] = p
    unused = [a for a in mesh.names if a not in roles]
    if unused:
        raise PassError(
            f"mesh axes {unused} of {mesh} are not used by plan {plan.preset!r}; add a preset for them "
            "(e.g. 'ddp+tp' for a (dp, tp) mesh) or drop them from the mesh"
        )
    return roles


def data_parallel_axes(roles: Mapping[str, str]) -> tuple[str, ...]:
    """The mesh axes (of ``axis_roles``) a preset splits the batch over: its ``ddp`` and ``fsdp``
    axes, and its ``cp`` axes, which split each input's sequence instead. The sharding solve keeps
    the batch split on them (``Problem.batch_axes``); ``auto`` has none."""
    return tuple(a for a, role in roles.items() if role in ("ddp", "fsdp", "cp"))


def sequence_axes(roles: Mapping[str, str]) -> tuple[str, ...]:
    """The mesh axes (of ``axis_roles``) a preset splits the sequence over: its ``cp`` axes."""
    return tuple(a for a, role in roles.items() if role == "cp")


def resolve(plan: Plan, graph: Graph, mesh: Mesh) -> Seeds:
    """Seeds for every graph input: parameters by preset then user override, user inputs batch-sharded."""
    roles = axis_roles(plan, mesh)
    tp_roles = megatron_roles(graph) if "tp" in roles.values() else {}
    data_axes = [a for a in mesh.names if a in data_parallel_axes(roles)]
    batch = [a for a in data_axes if roles[a] != "cp"]
    split = batch_split(graph, mesh, batch)
    seeds = Seeds(roles=roles, whole=tuple(a for a in batch if a not in split))
    # NOTE: a parameter's layouts read only its shape and Megatron role: every layer's are alike
    kept: dict[tuple[tuple[Dim, ...], str | None], tuple[Layout, Layout]] = {}
    for i in graph.inputs:
        t = i.value.type
        if not isinstance(t, TensorType):
            continue
        if i.kind == "input":
            layout = _batch_layout(i.name, t, mesh, split)
            for axis in sequence_axes(roles):
                layout = _sequence_split(i.name, t, mesh, axis, layout)
            seeds.storage[i.name] = seeds.compute[i.name] = layout
        elif i.kind in ("param", "buffer"):
            key = (t.shape, tp_roles.get(i.name))
            if key not in kept:
                kept[key] = _param_layouts(i.name, t, mesh, roles, key[1])
            store, comp = kept[key]
            seeds.storage[i.name], seeds.compute[i.name] = store, comp
            if i.kind == "param":
                seeds.unsplit.extend(_unsplit(i.name, t, mesh, roles, tp_roles.get(i.name), store))
        else:
            seeds.storage[i.name] = seeds.compute[i.name] = Layout.replicated(mesh)
    _apply_overrides(plan, graph, mesh, seeds)
    return seeds


def batch_split(graph: Graph, mesh: Mesh, axes: Sequence[str]) -> list[str]:
    """Which of the data-parallel ``axes`` the inputs' batch (dim 0) is split over: all of them when
    their ranks divide it, else the subset with the most ranks that does (the outer axes on a tie),
    none when no axis does.

    NOTE: an axis left out computes the whole of its part of the batch on each of its ranks (the
    gradients need no reduction over it), so a last, smaller batch that the ranks do not divide
    trains equal to one device; the part's activations are then that many times a split batch's,
    which the memory pass prices like any other."""
    sizes = {
        int(t.shape[0])
        for i in graph.inputs
        if i.kind == "input" and isinstance(t := i.value.type, TensorType) and t.rank and isinstance(t.shape[0], int)
    }
    best: tuple[int, tuple[str, ...]] = (1, ())
    many = [a for a in axes if mesh.size(a) > 1]
    for n in range(len(many), 0, -1):
        for subset in itertools.combinations(many, n):
            ways = math.prod(mesh.size(a) for a in subset)
            if ways > best[0] and all(b % ways == 0 for b in sizes):
                best = (ways, subset)
    # NOTE: an axis of one rank splits any batch
    return [a for a in axes if a in best[1] or mesh.size(a) == 1]


def _batch_layout(name: str, t: TensorType, mesh: Mesh, data_axes: list[str]) -> Layout:
    if not data_axes or t.rank == 0:
        return Layout.replicated(mesh)
    ways = 1
    for a in data_axes:
        ways *= mesh.size(a)
    if not isinstance(t.shape[0], int) or t.shape[0] % ways:
        raise PassError(
            f"input {name!r} has batch size {t.shape[0]} (dim 0 of {t}), not divisible by the {ways} data-parallel "
            f"ranks of {mesh} (axes {data_axes}); use a batch that is a multiple of {ways}"
        )
    return Layout.on(mesh, **{a: Shard(0) for a in data_axes})


def _sequence_split(name: str, t: TensorType, mesh: Mesh, axis: str, layout: Layout) -> Layout:
    """``layout`` with the sequence (dim 1) of input ``name`` split over the ``cp`` axis ``axis``."""
    if t.rank < 2:
        return layout
    if not isinstance(t.shape[1], int) or t.shape[1] % mesh.size(axis):
        raise PassError(
            f"input {name!r} has sequence length {t.shape[1]} (dim 1 of {t}), not divisible by the "
            f"{mesh.size(axis)} context-parallel ranks of mesh axis {axis!r}; use a multiple of {mesh.size(axis)}"
        )
    return layout.with_placement(axis, Shard(1))


def _param_layouts(
    name: str, t: TensorType, mesh: Mesh, roles: dict[str, str], tp_role: str | None
) -> tuple[Layout, Layout]:
    store: dict[str, Placement] = {}
    comp: dict[str, Placement] = {}
    # NOTE: tp axes choose first so fsdp shards another dim: gathering the fsdp axis then leaves
    # the tp shard in place instead of gathering both and slicing the tp half back out.
    for axis in sorted(mesh.names, key=lambda a: roles[a] != "tp"):
        role = roles[axis]
        if role == "tp" and tp_role is not None:
            dim = 1 if tp_role == "row" else 0
            if t.rank > dim and _divides(t.shape[dim], mesh.size(axis)):
                store[axis] = comp[axis] = Shard(dim)
        elif role == "fsdp":
            taken = {p.dim for p in store.values() if isinstance(p, Shard)}
            for d in [*(d for d in range(t.rank) if d not in taken), *sorted(taken)]:
                if _divides(t.shape[d] // _ways(store, mesh, d), mesh.size(axis)):
                    store[axis] = Shard(d)
                    comp[axis] = R
                    break
    return Layout.on(mesh, **store), Layout.on(mesh, **comp)


def _unsplit(
    name: str, t: TensorType, mesh: Mesh, roles: dict[str, str], tp_role: str | None, store: Layout
) -> list[str]:
    """Why the preset left ``name`` whole on an axis it meant to split it over (tp: the Megatron
    dim does not divide; fsdp: no dim does), one line each; empty when it split as meant."""
    out = []
    for axis in mesh.names:
        if isinstance(store.placement(axis), Shard):
            continue
        n = mesh.size(axis)
        if roles[axis] == "tp" and tp_role is not None and t.rank > (dim := 1 if tp_role == "row" else 0):
            out.append(
                f"plan {roles[axis]!r}: parameter {name} {t} is {tp_role}-parallel, but its dim {dim} (size "
                f"{t.shape[dim]}) does not divide over the {n} ranks of mesh axis {axis!r}, so it stays replicated "
                f"there (every rank computes its whole layer); use a tp size that divides {t.shape[dim]}, or a plan "
                f"entry for {name!r}"
            )
        elif roles[axis] == "fsdp" and t.rank > 0 and _numel(t) >= n:
            out.append(
                f"plan 'fsdp': parameter {name} {t} has no dim that divides over the {n} ranks of mesh axis "
                f"{axis!r}, so every rank stores it whole"
            )
    return out


def _numel(t: TensorType) -> int:
    total = 1
    for d in t.shape:
        total *= d if isinstance(d, int) else 0
    return total


def _ways(store: dict[str, Placement], mesh: Mesh, dim: int) -> int:
    ways = 1
    for a, p in store.items():
        if isinstance(p, Shard) and p.dim == dim:
            ways *= mesh.size(a)
    return ways


def _divides(size: object, n: int) -> bool:
    return isinstance(size, int) and size % n == 0 and size >= n  # NOTE: parameters have static sizes


def _apply_overrides(plan: Plan, graph: Graph, mesh: Mesh, seeds: Seeds) -> None:
    for glob, axes in plan.overrides:
        matched = [i for i in graph.inputs if i.kind in ("param", "buffer") and fnmatch.fnmatchcase(i.name, glob)]
        if not matched:
            raise PassError(f"plan entry {glob!r} matches no parameter or buffer; check the FQN glob")
        for axis, text in axes:
            if axis not in mesh.names:
                raise PassError(f"plan entry {glob!r} names mesh axis {axis!r}, but {mesh} has axes {list(mesh.names)}")
            try:
                placement = parse_placement(text)
            except ValueError as e:
                raise PassError(f"plan entry {glob!r}, axis {axis!r}: {e}") from None
            for i in matched:
                t = i.value.type
                assert isinstance(t, TensorType)
                if isinstance(placement, Shard):
                    _check_shard(i.name, t, placement.dim, axis, mesh, seeds.storage[i.name])
                seeds.storage[i.name] = seeds.storage[i.name].with_placement(axis, placement)
                seeds.compute[i.name] = seeds.compute[i.name].with_placement(axis, placement)


def _check_shard(name: str, t: TensorType, dim: int, axis: str, mesh: Mesh, current: Layout) -> None:
    if not 0 <= dim < t.rank:
        raise PassError(f"plan shards {name!r} : {t} on dim {dim} over {axis!r}, but it has rank {t.rank}")
    ways = mesh.size(axis)
    for a, p in zip(current.axes, current.placements, strict=True):
        if a != axis and isinstance(p, Shard) and p.dim == dim:
            ways *= mesh.size(a)
    size = t.shape[dim]
    if not isinstance(size, int) or size % ways:
        raise PassError(
            f"plan shards {name!r} : {t} on dim {dim} (size {size}) over mesh axis {axis!r} "
            f"({ways} ways in all), which does not divide it; pick a dim divisible by {ways} or 'R'"
        )
