"""``bucket``: merge many small all-gathers, reduce-scatters and all-reduces into few flat ones.

Every collective costs a fixed latency however small (about a millisecond between gloo ranks on
one CPU, tens of microseconds with NCCL), and a per-parameter all-gather or gradient
reduce-scatter pays it once per parameter. This pass groups them the way FSDP groups a block's
parameters:

* an ``all_gather`` of a graph input (a parameter's fsdp shard) can run as early as we like, so
  the all-gathers of one block (module path up to its first index, ``layers.3``) in one phase
  become one ``comm.all_gather_bucket`` placed where the block's first one was;
* a ``reduce_scatter`` whose result only feeds graph outputs (a gradient on its way out) can run
  as late as we like, so one block's become one ``comm.reduce_scatter_bucket`` placed where the
  block's last one was;
* so can an ``all_reduce`` whose result only feeds graph outputs (a replicated parameter's
  gradient, as data parallelism without sharding makes it): one block's become one
  ``comm.all_reduce_bucket`` placed where the block's last one was.

Buckets hold one dtype, one axis, one phase and at most ``mb`` MiB of the collective's operands.
Values, types and layouts are unchanged: only where and how the collectives run.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from meshfold.ir import Graph, GraphBuilder, Op, TensorType, Value, is_view
from meshfold.ir.graph import Provenance
from meshfold.ir.ops import (
    ALL_GATHER,
    ALL_GATHER_BUCKET,
    ALL_REDUCE,
    ALL_REDUCE_BUCKET,
    REDUCE_SCATTER,
    REDUCE_SCATTER_BUCKET,
)
from meshfold.passes.base import Pass, PassError
from meshfold.passes.blocks import op_blocks
from meshfold.passes.precision import CAST
from meshfold.passes.sharding.boxing import BOXED
from meshfold.passes.sharding.cost import nbytes

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

BUCKETED = "bucketed"


@dataclass(frozen=True)
class Bucket(Pass):
    """Group per-block parameter all-gathers, gradient reduce-scatters and all-reduces (``bucket{mb=64}``)."""

    name: ClassVar[str] = "bucket"
    requires: ClassVar[frozenset[str]] = frozenset({BOXED})
    ensures: ClassVar[frozenset[str]] = frozenset({BUCKETED})
    invalidates: ClassVar[frozenset[str]] = frozenset({"scheduled"})  # NOTE: moves collectives only
    mb: float = 64.0

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        if self.mb <= 0:
            raise PassError(f"bucket{{mb={self.mb}}}: the bucket size must be positive (MiB)")
        if graph.mesh is None:
            return graph
        readers = _readers(graph)
        carried: dict[int, list[int]] = {}  # NOTE: member -> the views that move with it (``_way_out``)
        casts: dict[int, int] = {}  # NOTE: gather member -> the cast of a parameter it reads (``_cast_input``)
        groups = _groups(graph, readers, carried, self.mb * 2**20, (ctx.options.pp is not None), casts)
        # NOTE: op index where a bucket is emitted -> (block, member indices)
        anchor = {m[0] if kind == "gather" else m[-1]: (block, m) for kind, block, m in groups if len(m) > 1}
        while True:
            placed = {k: at for at, (_, m) in anchor.items() for k in m}
            late = [at for at, (_, m) in anchor.items() if _read_before(graph, readers, carried, placed, at, m)]
            if not late:
                break
            for at in late:
                del anchor[at]
        after = {at: sorted(v for k in m for v in carried.get(k, ())) for at, (_, m) in anchor.items()}
        before = {at: [casts[k] for k in m if k in casts] for at, (_, m) in anchor.items()}
        skip = {k for _, m in anchor.values() for k in m} | {
            v for vs in [*after.values(), *before.values()] for v in vs
        }
        b = GraphBuilder.like(graph)
        for k, op in enumerate(graph.ops):
            if k in anchor:
                for c in before[k]:
                    b.append(graph.ops[c])
                b.append(_merged([graph.ops[m] for m in anchor[k][1]], anchor[k][0]))
                for v in after[k]:
                    b.append(graph.ops[v])
            elif k not in skip:
                b.append(op)
        for o in graph.outputs:
            b.add_output(o.kind, o.name, o.value)
        return b.build()


def _readers(graph: Graph) -> dict[Value, list[int]]:
    """Each value -> the indices of the ops that read it, in program order (``Graph.users`` by index)."""
    out: dict[Value, list[int]] = {}
    for k, op in enumerate(graph.ops):
        for v in dict.fromkeys(op.operands):
            out.setdefault(v, []).append(k)
    return out


def _read_before(
    graph: Graph,
    readers: dict[Value, list[int]],
    carried: dict[int, list[int]],
    placed: dict[int, int],
    at: int,
    members: list[int],
) -> bool:
    """Whether an op reading a result of the bucket emitted at ``at`` would be emitted before it (a
    gradient's all-reduce over one axis read by its all-reduce over another, in another bucket);
    ``placed``: each bucketed op's index -> where its bucket is emitted. The views carried along
    with a member come right after its bucket."""
    return any(
        placed.get(r, r) <= at
        for k in members
        for r in readers.get(graph.ops[k].result, ())
        if r not in carried.get(k, ())
    )


def _groups(
    graph: Graph,
    readers: dict[Value, list[int]],
    carried: dict[int, list[int]],
    cap: float,
    pipelined: bool = False,
    casts: dict[int, int] | None = None,
) -> list[tuple[str, str, list[int]]]:
    """(kind, block, op indices in program order) of every bucket. A gradient's reduce-scatter on
    its way out belongs to the block that computed the gradient (``op_blocks``). ``pipelined``: ops of
    no block group by their module (the embedding apart from the final norm and the output layer:
    different pipeline stages run them). An all-reduce read only by other all-reduces (a gradient
    reduced over one axis, then another) may join a bucket too: ``Bucket.apply`` keeps that bucket
    only where its readers come after it. ``carried`` gets, for each reduction joining a bucket, the
    views that take its result to the outputs (``_way_out``). ``casts`` gets, for each all-gather of a
    parameter's cast (the ``precision`` pass's), the index of that cast: it moves with the bucket."""
    inputs = {i.value for i in graph.inputs}
    made_at = {r: k for k, op in enumerate(graph.ops) for r in op.results}
    keyed: dict[tuple[object, ...], list[int]] = defaultdict(list)
    blocks = op_blocks(graph)
    made = graph.producers() if pipelined else {}
    for k, op in enumerate(graph.ops):
        (x,) = op.operands if op.target in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE) else (None,)
        if x is None or not isinstance(x.type, TensorType):
            continue
        axis, block = op.kwarg("axis"), blocks[k]
        if pipelined and not block:
            source = made[x].prov.module if x in made else op.prov.module
            block = op.prov.module or source
        cast = _cast_input(graph, readers, inputs, made_at, x) if op.target == ALL_GATHER else None
        if cast is not None and casts is not None:
            casts[k] = cast
        if op.target == ALL_GATHER and (x in inputs or (cast is not None and casts is not None)):
            keyed[("gather", axis, op.prov.phase, x.type.dtype, block)].append(k)
        elif op.target != ALL_GATHER and op.kwarg("reduce") in ("sum", "avg"):
            views = _way_out(graph, readers, op)
            if views is None:
                continue
            carried[k] = views
            kind = "scatter" if op.target == REDUCE_SCATTER else "reduce"
            keyed[(kind, axis, op.prov.phase, x.type.dtype, block, op.kwarg("reduce"))].append(k)
    out: list[tuple[str, str, list[int]]] = []
    for key, members in keyed.items():
        cur: list[int] = []
        size = 0.0
        for k in members:
            t = graph.ops[k].operands[0].type
            assert isinstance(t, TensorType)
            if cur and size + nbytes(t) > cap:
                out.append((str(key[0]), str(key[4]), cur))
                cur, size = [], 0.0
            cur.append(k)
            size += nbytes(t)
        out.append((str(key[0]), str(key[4]), cur))
    return out


def _cast_input(
    graph: Graph, readers: dict[Value, list[int]], inputs: set[Value], made_at: dict[Value, int], x: Value
) -> int | None:
    """The index of the op making ``x`` when it is a cast of a graph input read by one op only (the
    ``precision`` pass's cast of a parameter shard before its all-gather), else None."""
    k = made_at.get(x)
    if k is None or len(readers.get(x, ())) != 1:
        return None
    op = graph.ops[k]
    return k if op.target == CAST and len(op.operands) == 1 and op.operands[0] in inputs else None


def _way_out(graph: Graph, readers: dict[Value, list[int]], op: Op) -> list[int] | None:
    """None unless ``op``'s result feeds graph outputs only: directly, through a view read by nothing
    else (a norm weight's gradient summed as ``[1, 1, d]`` and viewed as ``[d]``), or (an
    all-reduce's) through other all-reduces on their way out, as a gradient reduced over two axes in
    turn. Else the indices of those views: they can move to wherever the reduction goes."""
    views: list[int] = []
    for r in readers.get(op.result, ()):
        reader = graph.ops[r]
        if is_view(reader.target) and len(reader.results) == 1 and not readers.get(reader.results[0]):
            views.append(r)
        else:
            chained = op.target == reader.target == ALL_REDUCE and reader.kwarg("reduce") in ("sum", "avg")
            if not chained or _way_out(graph, readers, reader) is None:
                return None
    return views


_BUCKETS = {ALL_GATHER: ALL_GATHER_BUCKET, REDUCE_SCATTER: REDUCE_SCATTER_BUCKET, ALL_REDUCE: ALL_REDUCE_BUCKET}


def _merged(members: list[Op], block: str) -> Op:
    first = members[0]
    target = _BUCKETS[first.target]  # type: ignore[index]
    kwargs: list[tuple[str, object]] = [("axis", first.kwarg("axis"))]
    if target != ALL_REDUCE_BUCKET:
        kwargs.append(("dims", tuple(int(m.kwarg("dim")) for m in members)))  # type: ignore[arg-type]
    if target != ALL_GATHER_BUCKET:
        kwargs.append(("reduce", first.kwarg("reduce")))
    prov = Provenance(block, first.prov.phase, first.prov.source)
    operands = tuple(m.operands[0] for m in members)
    results = tuple(m.result for m in members)
    return Op(target, operands, tuple(kwargs), results, prov)  # type: ignore[arg-type]
