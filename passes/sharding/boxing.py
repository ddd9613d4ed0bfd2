"""``boxing``: lower every ``comm.redistribute`` to the collectives that realize it.

Per mesh axis: ``S(d)→R`` all-gather, ``P→R`` all-reduce, ``P→S(d)`` reduce-scatter (not all-reduce
then slice), ``S(d)→S(e)`` all-to-all, ``R→S(d)`` a local chunk, ``R→P`` a local partial. Axes are
unsharded right to left and sharded left to right so that a dim split over several axes keeps
the mesh's nesting order (outer axis first).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, ClassVar

from meshfold.ir import (
    Graph,
    GraphBuilder,
    Layout,
    Op,
    OpDef,
    Partial,
    Placement,
    R,
    Replicate,
    Shard,
    Value,
)
from meshfold.ir.graph import remap_op
from meshfold.ir.ops import REDISTRIBUTE, collective_for
from meshfold.passes.base import Pass
from meshfold.passes.sharding.propagate import SHARDED

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

BOXED = "boxed"


@lru_cache(maxsize=1024)
def _planned(src: Layout, dst: Layout) -> tuple[tuple[Layout, Emitter], ...]:
    """``plan_steps``, kept per pair of layouts: the values of every layer move between the same few
    (the steps and their layouts are immutable, so one plan serves every move alike)."""
    return tuple(plan_steps(src, dst))


Step = tuple[Layout, "Emitter"]


class Emitter:
    """One collective on one axis: builds the op when called."""

    def __init__(self, target: OpDef, axis: str, **attrs: object) -> None:
        self.target, self.axis, self.attrs = target, axis, attrs
        self.kwargs = (("axis", axis), *sorted(attrs.items()))

    @staticmethod
    def between(axis: str, src: Placement, dst: Placement) -> Emitter:
        """The one collective taking ``src`` to ``dst`` on ``axis`` (``ir.ops.collective_for``)."""
        target, attrs = collective_for(src, dst)
        return Emitter(target, axis, **dict(attrs))

    def transfer(self, layout: Layout) -> Layout:
        """The layout after this step, by the collective's own transfer function."""
        return self.target.transfer(layout, {"axis": self.axis, **self.attrs})

    def op(self, like: Op, v: Value, out: Value) -> Op:
        """This step of the redistribute ``like``, taking ``v`` to ``out``."""
        return Op(self.target, (v,), self.kwargs, (out,), like.prov)  # type: ignore[arg-type]


def plan_steps(src: Layout, dst: Layout) -> list[tuple[Layout, Emitter]]:
    """The sequence of (layout after the step, step) turning ``src`` into ``dst``."""
    steps: list[tuple[Layout, Emitter]] = []
    cur = src
    axes = list(src.axes)
    # NOTE: (axis, dim) pairs whose sharding changes. An inner axis holding S(d) must be gathered
    # (and re-sharded in phase 2) whenever an outer axis changes its sharding of the same dim d.
    changing = {
        (i, p.dim)
        for i in range(len(cur.axes))
        if cur.placements[i] != dst.placements[i]
        for p in (cur.placements[i], dst.placements[i])
        if isinstance(p, Shard)
    }

    def blocks_nesting(i: int, dim: int) -> bool:
        return any(j < i and d == dim for j, d in changing)

    # NOTE: phase 1, right to left: take every axis that must change out of Shard/Partial.
    for i in reversed(range(len(axes))):
        s, d = cur.placements[i], dst.placements[i]
        if s == d:
            if isinstance(s, Shard) and blocks_nesting(i, s.dim):
                cur = _step(steps, cur, Emitter.between(axes[i], s, R))
            continue
        # NOTE: never move straight into S(d) while an outer axis still has to change dim d.
        direct = isinstance(d, Shard) and not blocks_nesting(i, d.dim)
        if isinstance(s, Shard):
            other_shards = {p.dim for j, p in enumerate(cur.placements) if j != i and isinstance(p, Shard)}
            if direct and isinstance(d, Shard) and d.dim not in other_shards and s.dim not in other_shards:
                cur = _step(steps, cur, Emitter.between(axes[i], s, d))
            else:
                cur = _step(steps, cur, Emitter.between(axes[i], s, R))
        elif isinstance(s, Partial):
            later_shards = {p.dim for j, p in enumerate(cur.placements) if j > i and isinstance(p, Shard)}
            if direct and isinstance(d, Shard) and d.dim not in later_shards:
                cur = _step(steps, cur, Emitter.between(axes[i], s, d))
            else:
                cur = _step(steps, cur, Emitter.between(axes[i], s, R))
    # NOTE: phase 2, left to right: from Replicate to the target placement.
    for i in range(len(axes)):
        s, d = cur.placements[i], dst.placements[i]
        if s == d:
            continue
        assert isinstance(s, Replicate), f"boxing left {s} on axis {axes[i]} (from {src} to {dst})"
        cur = _step(steps, cur, Emitter.between(axes[i], s, d))
    # NOTE: an axis that phase 1 gathered only to keep nesting order is re-sharded by phase 2,
    # so every axis now matches.
    assert cur == dst, f"boxing reached {cur}, not {dst}"
    return steps


def _step(steps: list[tuple[Layout, Emitter]], cur: Layout, e: Emitter) -> Layout:
    nxt = e.transfer(cur)
    steps.append((nxt, e))
    return nxt


@dataclass(frozen=True)
class Boxing(Pass):
    """Replace each ``comm.redistribute`` by concrete ``comm.*`` collectives (cheapest per-axis path)."""

    name: ClassVar[str] = "boxing"
    requires: ClassVar[frozenset[str]] = frozenset({SHARDED})
    ensures: ClassVar[frozenset[str]] = frozenset({BOXED})
    invalidates: ClassVar[frozenset[str]] = frozenset()

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        if graph.mesh is None:
            return graph
        return _lowered(graph)


def _lowered(graph: Graph) -> Graph:
    """``graph`` with every redistribute lowered into its steps (``plan_steps``) in one walk: the last
    step defines the redistribute's own result (in the same layout), so every other op is kept as it
    is and none reading a moved value is rebuilt."""
    b = GraphBuilder.like(graph)
    vmap: dict[Value, Value] = {}
    for op in graph.ops:
        op = remap_op(op, vmap)
        if op.target is not REDISTRIBUTE:
            b.append(op)
            continue
        (cur,) = op.operands
        steps = _planned(cur.layout, op.result.layout)
        if not steps:  # NOTE: a move to the layout it has (sharding makes none): its readers read the value
            vmap[op.result] = cur
            continue
        for layout, emit in steps[:-1]:
            new = Value(op.result.name, cur.type, layout)
            b.append(emit.op(op, cur, new))
            cur = new
        b.append(steps[-1][1].op(op, cur, op.result))
    for o in graph.outputs:
        b.add_output(o.kind, o.name, vmap.get(o.value, o.value))
    return b.build()
