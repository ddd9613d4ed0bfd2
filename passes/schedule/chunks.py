"""Collective matmul: a GEMM and the reduction of its partial result, split into chunks so that one
chunk's collective runs under the next chunk's GEMM.

``y = mm(x, w)`` whose result is a Partial sum on a mesh axis and whose only reader is an
``all_reduce`` over that axis, or a ``reduce_scatter`` over it on a dim other than the last,
directly or through a reshape that keeps its last dim (``[b*s, n] -> [b, s, n]``; a row-parallel
projection in the forward, a column-parallel one's input gradient in the backward; a
sequence-parallel one reduce-scattering its tokens), becomes, for ``k`` chunks of ``w``'s output
columns:

    w_i = slice(w, 1, i*n/k, (i+1)*n/k);  y_i = mm(x, w_i);  r_i = reduce(y_i);  y = cat(r, -1)

The columns are split only where no mesh axis shards them (``w``'s dim 1 and ``y``'s last dim), so
every rank slices the same global columns, and a reduce-scatter's pieces are scattered on the same
rows: the result is the same value in the same layout. The overlap pass then starts ``r_i`` as soon
as ``y_i`` exists and runs ``y_{i+1}`` under it.
"""

from __future__ import annotations

import torch

from meshfold.ir import Graph, GraphBuilder, Op, Shard, TensorType, Value
from meshfold.ir.graph import fresh_name
from meshfold.ir.ops import ALL_REDUCE, REDUCE_SCATTER
from meshfold.ir.symbolic import divides

aten = torch.ops.aten


def chunk_matmuls(graph: Graph, k: int) -> Graph:
    """``graph`` with every GEMM + all-reduce (or reduce-scatter) pair that splits evenly into ``k``
    column chunks split."""
    if k <= 1 or graph.mesh is None:
        return graph
    users = graph.users()
    outputs = {o.value for o in graph.outputs}
    names = {i.value.name for i in graph.inputs} | {r.name for op in graph.ops for r in op.results}
    pairs: dict[Op, tuple[Op | None, Op]] = {}
    producers = graph.producers()
    for op in graph.ops:
        if op.target not in (ALL_REDUCE, REDUCE_SCATTER) or op.kwarg("reduce") != "sum":
            continue
        (y,) = op.operands
        if op.target == REDUCE_SCATTER and (not isinstance(y.type, TensorType) or op.kwarg("dim") == y.type.rank - 1):
            continue  # NOTE: scattered on the columns the chunks split
        view = producers.get(y)
        if view is not None and view.target in RESHAPES and _keeps_last(view):
            mm = producers.get(view.operands[0])
            lone = mm is not None and users.get(view.operands[0]) == [view]
            if mm is None or not lone or view.operands[0] in outputs:
                continue
        else:
            mm, view = view, None
        if mm is not None and _splits(mm, y, k) and users.get(y) == [op] and y not in outputs:
            pairs[mm] = (view, op)
    if not pairs:
        return graph
    skip = {o for view, red in pairs.values() for o in (view, red) if o is not None}
    b = GraphBuilder.like(graph)
    for op in graph.ops:
        if op in skip:
            continue
        if op not in pairs:
            b.append(op)
            continue
        _emit_chunks(b, op, *pairs[op], k, names)
    for o in graph.outputs:
        b.add_output(o.kind, o.name, o.value)
    return b.build()


RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
"""The reshapes the schedule's splitting rewrites see through (their shape argument is respelled)."""


def _keeps_last(view: Op) -> bool:
    """A reshape of a 2-D GEMM result that keeps its last dim (``[b*s, n] -> [b, s, n]``)."""
    src, out = view.operands[0].type, view.result.type
    return (
        isinstance(src, TensorType) and isinstance(out, TensorType) and src.rank == 2 and out.shape[-1] == src.shape[1]
    )


def _splits(mm: Op, y: Value, k: int) -> bool:
    """``mm`` is a GEMM whose output columns no mesh axis shards (nor those of ``y``, what is reduced)
    and ``k`` divides them."""
    if mm.target != aten.mm.default or len(mm.operands) != 2:
        return False
    w = mm.operands[1]
    if not isinstance(w.type, TensorType) or not isinstance(y.type, TensorType):
        return False
    last = Shard(y.type.rank - 1)
    unsharded = Shard(1) not in w.layout.placements and Shard(1) not in mm.result.layout.placements
    return unsharded and last not in y.layout.placements and divides(w.type.shape[1], k)


def _emit_chunks(b: GraphBuilder, mm: Op, view: Op | None, red: Op, k: int, names: set[str]) -> None:
    x, w = mm.operands
    m, out = mm.result, red.result
    y = view.result if view is not None else m
    assert isinstance(w.type, TensorType) and isinstance(m.type, TensorType) and isinstance(y.type, TensorType)
    step = w.type.shape[1] // k
    pieces = []
    for i in range(k):
        w_i = Value(fresh_name(f"{w.name}_c{i}", names), TensorType((w.type.shape[0], step), w.type.dtype), w.layout)
        b.append(Op(aten.slice.Tensor, (w, 1, i * step, (i + 1) * step), (), (w_i,), mm.prov))
        m_i = Value(fresh_name(f"{m.name}_c{i}", names), TensorType((m.type.shape[0], step), m.type.dtype), m.layout)
        b.append(Op(mm.target, (x, w_i), mm.kwargs, (m_i,), mm.prov))
        y_i, yt = m_i, TensorType((*y.type.shape[:-1], step), y.type.dtype)
        if view is not None:
            y_i = Value(fresh_name(f"{y.name}_c{i}", names), yt, y.layout)
            b.append(Op(view.target, (m_i, (*y.type.shape[:-1], step)), view.kwargs, (y_i,), view.prov))
        r_i = Value(fresh_name(f"{out.name}_c{i}", names), yt, out.layout)
        b.append(Op(red.target, (y_i,), red.kwargs, (r_i,), red.prov))
        pieces.append(r_i)
    b.append(Op(aten.cat.default, (tuple(pieces), y.type.rank - 1), (), (out,), red.prov))
