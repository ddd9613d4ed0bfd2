"""Nano-batching: a sequence-parallel region's tokens split into ``k`` nano-batches, so that one
nano-batch's all-gather or reduce-scatter runs under another's GEMMs.

A region starts at an ``all_gather`` of a token tensor ``x: [T0, T1, *features]`` over a mesh axis
on one token dim (``g``) and takes in every op after it that works on each token alone:

* a reshape between ``[T0, T1, *f]`` and the flattened ``[T0 * T1, *f]``;
* ``mm(v, w)`` on the flattened tokens, with ``w`` from outside the region (a weight);
* a pointwise op (not a random one) whose other tensor operands are region values of its shape,
  or from outside the region and broadcast over the features only (rank 0 or 1);
* a ``reduce_scatter`` over the gather's axis back onto the gathered token dim.

Each nano-batch takes ``1/k`` of the other token dim (``c``, which no mesh axis may shard): the
piece ``slice(x, c, ...)`` is gathered on its own, so every piece is a contiguous slice of the
gathered tensor on ``c`` and every op of the region runs on it unchanged but for the sizes it
spells. A region value read outside the region (an activation the backward keeps, the
reduce-scattered result) is put back together by a ``cat`` on ``c`` (the flattened form through a
view to ``[T0, T1/k, *f]`` and back when ``c`` is the inner token dim), under its own name: the
program computes the same values in the same layouts. The overlap scheduler then runs nano-batch
``i + 1``'s gather under nano-batch ``i``'s GEMMs, and ``i``'s reduce-scatter under ``i + 1``'s.

A region whose outside readers come before its last op, whose sizes do not split evenly, or whose
flattened rows a mesh axis shards across more than ``T0`` is left whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from meshfold.ir import Graph, GraphBuilder, Layout, Op, Shard, TensorType, Value
from meshfold.ir.graph import Provenance, fresh_name, map_values
from meshfold.ir.ops import ALL_GATHER, REDUCE_SCATTER
from meshfold.ir.symbolic import Dim, divides
from meshfold.passes.schedule.chunks import RESHAPES

aten = torch.ops.aten


def nano_batch(graph: Graph, k: int) -> Graph:
    """``graph`` with every sequence-parallel region (module doc) split into ``k`` nano-batches."""
    if k <= 1 or graph.mesh is None:
        return graph
    users, at = graph.users(), {op: n for n, op in enumerate(graph.ops)}
    outputs = {o.value for o in graph.outputs}
    regions: dict[Op, _Region] = {}  # NOTE: keyed by the region's last op
    taken: set[Op] = set()
    for op in graph.ops:
        if op.target == ALL_GATHER and op not in taken:
            region = _grow(op, users, outputs, at)
            if region is not None and taken.isdisjoint(region.ops) and _splits(graph, region, k, at, users):
                regions[region.ops[-1]] = region
                taken.update(region.ops)
    if not regions:
        return graph
    names = {i.value.name for i in graph.inputs} | {r.name for op in graph.ops for r in op.results}
    b = GraphBuilder.like(graph)
    for op in graph.ops:
        if op in regions:
            _emit(b, regions[op], k, names)
        elif op not in taken:
            b.append(op)
    for o in graph.outputs:
        b.add_output(o.kind, o.name, o.value)
    return b.build()


@dataclass
class _Region:
    gather: Op
    tokens: tuple[Dim, Dim]
    """``(T0, T1)``: the gathered tensor's token dims (global sizes)."""
    c: int
    """The token dim the nano-batches split (0 or 1, in the ``[T0, T1, *f]`` form)."""
    flat: dict[Value, bool] = field(default_factory=dict)
    """Every region value: True where it is in the flattened ``[T0 * T1, *f]`` form."""
    ops: list[Op] = field(default_factory=list)
    leaving: list[Value] = field(default_factory=list)
    """Region values read outside the region (or graph outputs), in the order they are made."""


def _grow(gather: Op, users: dict[Value, list[Op]], outputs: set[Value], at: dict[Op, int]) -> _Region | None:
    """The region an all-gather starts (module doc), its ops in program order; None: it has no GEMM."""
    x = gather.operands[0]
    g = gather.kwarg("dim")
    if not isinstance(x.type, TensorType) or x.type.rank != 3 or g not in (0, 1):
        return None
    region = _Region(gather, (x.type.shape[0], x.type.shape[1]), 1 - int(g))
    region.ops.append(gather)
    region.flat[gather.result] = False
    frontier = [gather.result]
    while frontier:
        v = frontier.pop()
        for user in users.get(v, []):
            if user in region.ops:
                continue
            form = _form(user, region)
            if form is None:
                continue
            region.ops.append(user)
            for r in user.results:
                region.flat[r] = form
                frontier.append(r)
    region.ops.sort(key=at.__getitem__)
    inside = set(region.ops)
    region.leaving = [
        r for op in region.ops for r in op.results if r in outputs or any(u not in inside for u in users.get(r, []))
    ]
    if not any(op.target == aten.mm.default for op in region.ops):
        return None  # NOTE: nothing to run under a piece's collective
    return region


def _form(op: Op, region: _Region) -> bool | None:
    """Whether ``op``'s result joins the region flattened (True) or not (False); None: it stays out."""
    inside = [v for v in op.operands if v in region.flat]
    if len(op.results) != 1 or not inside or not isinstance(op.result.type, TensorType):
        return None
    v, out = inside[0], op.result.type
    t0, t1 = region.tokens
    if op.target in RESHAPES:
        src = v.type
        assert isinstance(src, TensorType)
        if not region.flat[v] and tuple(out.shape) == (t0 * t1, *src.shape[2:]):
            return True
        if region.flat[v] and tuple(out.shape) == (t0, t1, *src.shape[1:]):
            return False
        return None
    if op.target == aten.mm.default:
        x, w = op.operands
        return True if x is v and region.flat[v] and w not in region.flat else None
    if op.target == REDUCE_SCATTER:
        g = region.gather
        same_axis = op.kwarg("axis") == g.kwarg("axis") and op.kwarg("reduce") == "sum"
        dim = op.kwarg("dim")
        onto = dim == 0 and g.kwarg("dim") == 0 if region.flat[v] else dim == g.kwarg("dim")
        return region.flat[v] if same_axis and onto else None
    tags = getattr(op.target, "tags", ())
    if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags:
        return None  # NOTE: a random op drawn piece by piece would draw other numbers
    for o in op.operands:
        if o in region.flat:
            if region.flat[o] != region.flat[v] or o.type != out:
                return None
        elif not isinstance(o.type, TensorType) or o.type.rank > 1:
            return None
    return region.flat[v] if v.type == out else None


def _splits(graph: Graph, region: _Region, k: int, at: dict[Op, int], users: dict[Value, list[Op]]) -> bool:
    """The region splits evenly into ``k`` nano-batches, no mesh axis splits the nano-batches' dim
    (nor, flattened, the rows across more than ``T0`` pieces), and its outside readers come after it."""
    mesh = graph.mesh
    assert mesh is not None
    x, c = region.gather.operands[0], region.c
    if not divides(region.tokens[c], k):
        return False
    last = at[region.ops[-1]]
    inside = set(region.ops)
    if any(at[u] < last for v in region.leaving for u in users.get(v, []) if u not in inside):
        return False
    for v, flat in (*region.flat.items(), (x, False)):
        rows = [mesh.size(a) for a, p in zip(v.layout.axes, v.layout.placements, strict=True) if p == Shard(0)]
        if not flat and any(p == Shard(c) for p in v.layout.placements):
            return False
        if flat and ((c == 0 and rows) or not divides(region.tokens[0], math.prod(rows))):
            return False
    return True


def _emit(b: GraphBuilder, region: _Region, k: int, names: set[str]) -> None:
    x, c = region.gather.operands[0], region.c
    t0, t1 = region.tokens
    assert isinstance(x.type, TensorType)
    pieces: dict[Value, list[Value]] = {}
    step = (t0, t1)[c] // k
    for i in range(k):
        mapping: dict[Value, Value] = {}
        xs = _piece(x, i, names, c, k)
        b.append(Op(aten.slice.Tensor, (x, c, i * step, (i + 1) * step), (), (xs,), region.gather.prov))
        mapping[x] = xs
        for op in region.ops:
            results = tuple(_piece(r, i, names, 0 if region.flat[r] else c, k) for r in op.results)
            args = tuple(map_values(a, mapping) for a in op.args)
            if op.target in RESHAPES:
                args = (args[0], _shape(results[0]), *args[2:])
            b.append(Op(op.target, args, op.kwargs, results, op.prov))
            for r, p in zip(op.results, results, strict=True):
                mapping[r] = p
                pieces.setdefault(r, []).append(p)
    made = {r: op.prov for op in region.ops for r in op.results}
    for v in region.leaving:
        _join(b, v, pieces[v], region, names, made[v])


def _join(b: GraphBuilder, v: Value, parts: list[Value], region: _Region, names: set[str], prov: Provenance) -> None:
    """``v`` made again from its nano-batch pieces (module doc), under the provenance of the op that
    made it."""
    assert isinstance(v.type, TensorType)
    if not region.flat[v] or region.c == 0:
        b.append(Op(aten.cat.default, (tuple(parts), 0 if region.flat[v] else region.c), (), (v,), prov))
        return
    t0, t1 = region.tokens
    k = len(parts)
    whole = (t0, t1, *v.type.shape[1:])
    lay = _unflat(v.layout)
    rows = []
    for p in parts:
        r = Value(fresh_name(f"{p.name}_rows", names), TensorType((t0, t1 // k, *v.type.shape[1:]), v.type.dtype), lay)
        b.append(Op(aten.view.default, (p, _shape(r)), (), (r,), prov))
        rows.append(r)
    cat = Value(fresh_name(f"{v.name}_rows", names), TensorType(whole, v.type.dtype), lay)
    b.append(Op(aten.cat.default, (tuple(rows), 1), (), (cat,), prov))
    b.append(Op(aten.view.default, (cat, tuple(v.type.shape)), (), (v,), prov))


def _unflat(layout: Layout) -> Layout:
    """The layout of ``[T0 * T1, *f]`` seen as ``[T0, T1, *f]`` (a row shard is a ``T0`` shard)."""
    return Layout(
        layout.axes,
        tuple(Shard(p.dim + 1) if isinstance(p, Shard) and p.dim > 0 else p for p in layout.placements),
    )


def _piece(v: Value, i: int, names: set[str], dim: int, k: int) -> Value:
    """Nano-batch ``i`` of ``k`` of ``v``: ``1/k`` of its ``dim``, in its layout."""
    t = v.type
    assert isinstance(t, TensorType)
    shape = (*t.shape[:dim], t.shape[dim] // k, *t.shape[dim + 1 :])
    return Value(fresh_name(f"{v.name}_n{i}", names), TensorType(shape, t.dtype), v.layout)


def _shape(v: Value) -> tuple[Dim, ...]:
    assert isinstance(v.type, TensorType)
    return tuple(v.type.shape)
