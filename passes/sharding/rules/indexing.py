"""Indexing, gathering and scattering, and ops that order or accumulate along a dim: ``index``,
``index_put``, ``index_select``, ``gather``, ``scatter``/``scatter_add``, ``topk``, ``sort``,
``cumsum``, ``histc``.

Index values are global positions, so a dim that is indexed into (or sorted, or accumulated along)
stays whole; dims that only ride along shard on every operand that has them.
"""

from __future__ import annotations

import torch

from meshfold.ir import Op, Partial, R, Shard, TensorType, Value
from meshfold.ir.placement import ReduceOp
from meshfold.ir.symbolic import Dim
from meshfold.passes.sharding.cost import nbytes
from meshfold.passes.sharding.rules.operands import (
    einsum_of,
    int_arg,
    letters,
    norm_dim,
    op_arg,
    result_type,
    tensor_type_of,
    with_partials,
)
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies, replicate_only

aten = torch.ops.aten
RULES = RuleSet("indexing")
ALL_KINDS: tuple[ReduceOp, ...] = ("sum", "avg", "max")


def _t(op: Op, i: int) -> TensorType:
    t = tensor_type_of(op.operands[i])
    assert t is not None, f"{op.describe()}: operand {i} is not a tensor"
    return t


def _broadcast_shape(shapes: list[tuple[Dim, ...]]) -> tuple[Dim, ...] | None:
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for j in range(rank):
        sizes = {s[j - rank + len(s)] for s in shapes if j - rank + len(s) >= 0} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _advanced_index(op: Op) -> tuple[list[str], list[list[str]], list[str]] | None:
    """Letters for ``self[indices]`` (self, each index tensor, the indexed result), or None when the
    indices are masks or the layout is not the plain advanced-indexing one."""
    src = _t(op, 0)
    entries = op_arg(op, "indices", ())
    items = entries if isinstance(entries, tuple) else ()
    positions = [i for i, a in enumerate(items) if isinstance(a, Value)]
    idx_types = [tensor_type_of(a) for a in items if isinstance(a, Value)]
    if not positions or any(t is None or t.dtype in (torch.bool, torch.uint8) for t in idx_types):
        return None
    shapes = [t.shape for t in idx_types if t is not None]
    bshape = _broadcast_shape(shapes)
    if bshape is None:
        return None
    rest = [d for d in range(src.rank) if d not in positions]
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    start = positions[0] if adjacent else 0
    before = [d for d in rest if adjacent and d < start]
    after = [d for d in rest if d not in before]
    out_shape = (*(src.shape[d] for d in before), *bshape, *(src.shape[d] for d in after))
    names = letters(len(out_shape))
    self_g = ["_"] * src.rank
    for e, d in enumerate(before):
        self_g[d] = names[e]
    for k, d in enumerate(after):
        self_g[d] = names[len(before) + len(bshape) + k]
    idx_g = []
    for s in shapes:
        off = len(bshape) - len(s)
        idx_g.append(
            ["_" if (s[j] == 1 and bshape[j + off] != 1) else names[len(before) + j + off] for j in range(len(s))]
        )
    return self_g, idx_g, list(names) if len(out_shape) else []


@RULES.rule(aten.index.Tensor)
def index(op: Op) -> list[Strategy]:
    """``self[i0, i1]``: ``_ _ c, a b, a b -> a b c`` — the indexed dims of ``self`` stay whole, the
    broadcast dims of the index tensors shard with the result, ``self``'s other dims too; linear in
    ``self`` (every Partial kind passes with Replicate indices). Masks: Replicate only."""
    spec = _advanced_index(op)
    n = len(op.operands)
    if spec is None or tuple(result_type(op).shape) != _shape_of(op, spec):
        return replicate_only(n, 1)
    self_g, idx_g, out = spec
    base = einsum_strategies(einsum_of([self_g, *idx_g], [out]))
    return with_partials(base, n, 1, [((0,), k) for k in ALL_KINDS])


def _shape_of(op: Op, spec: tuple[list[str], list[list[str]], list[str]]) -> tuple[Dim, ...]:
    """The result shape the letters imply (a consistency check against the recorded type)."""
    sizes: dict[str, Dim] = {}
    for v, g in zip(op.operands, [spec[0], *spec[1]], strict=False):
        t = tensor_type_of(v)
        assert t is not None
        for d, letter in enumerate(g):
            if letter != "_":
                sizes[letter] = t.shape[d]
    return tuple(sizes.get(letter, -1) for letter in spec[2])


@RULES.rule(aten.index_put.default)
def index_put(op: Op) -> list[Strategy]:
    """``self[i] = values``: ``_ c, a, a c -> _ c`` — dims of ``self`` that are not indexed shard with
    the matching (right-aligned) dims of ``values``; indices Replicate. With ``accumulate`` the op is
    ``self + scatter(values)``, so ``P(sum)``/``P(avg)`` on both pass."""
    spec = _advanced_index(op)
    n = len(op.operands)
    if spec is None:
        return replicate_only(n, 1)
    self_g, idx_g, view = spec
    vals = _t(op, n - 1)
    off = len(view) - vals.rank
    keep = set(self_g) - {"_"}
    vals_g = [
        view[j + off] if j + off >= 0 and view[j + off] in keep and vals.shape[j] != 1 else "_"
        for j in range(vals.rank)
    ]
    base = einsum_strategies(einsum_of([self_g, *(["_"] * len(g) for g in idx_g), vals_g], [self_g]))
    if not op_arg(op, "accumulate", False):
        return base
    both = (0, n - 1)
    return with_partials(base, n, 1, [(both, "sum"), (both, "avg")])


def _along(op: Op, dim_name: str = "dim", default: int = 0) -> tuple[int, list[str]]:
    src = _t(op, 0)
    d = norm_dim(int_arg(op, dim_name, default), max(src.rank, 1))
    return d, letters(src.rank)


@RULES.rule(aten.gather.default)
def gather(op: Op) -> list[Strategy]:
    """``a _, a g -> a g`` for ``gather(dim=1)``: other dims shard where ``self`` and ``index`` have
    the same size; the index may shard along ``dim`` against a Replicate ``self``; linear in ``self``."""
    d, names = _along(op)
    src, idx = _t(op, 0), _t(op, 1)
    if src.rank != idx.rank:
        return replicate_only(2, 1)
    self_g = ["_" if (k == d or src.shape[k] != idx.shape[k]) else names[k] for k in range(src.rank)]
    idx_g = [names[k] if k == d else self_g[k] for k in range(src.rank)]
    base = einsum_strategies(einsum_of([self_g, idx_g], [idx_g]))
    out = with_partials(base, 2, 1, [((0,), k) for k in ALL_KINDS])
    if src.dtype.is_floating_point:
        # NOTE: ``self`` sharded along ``dim``: each rank gathers the indices it holds (masked, see
        # backends/local.py) and the sum over ranks is the whole gather.
        out.append(Strategy((Shard(d), R), (Partial("sum"),)))
    return out


@RULES.rule(aten.scatter.src, aten.scatter.value, aten.scatter_add.default)
def scatter(op: Op) -> list[Strategy]:
    """``a _, a _, a _ -> a _`` for ``scatter(dim=1)`` (self, index[, src]): ``dim`` stays whole, other
    dims shard where every operand has the full size. ``scatter_add`` is linear in (self, src) jointly;
    ``scatter.value`` keeps ``P(avg)``/``P(max)`` of ``self`` (and ``P(sum)`` when the value is 0)."""
    d, names = _along(op)
    types = [_t(op, i) for i in range(len(op.operands))]
    n = len(types)
    if any(t.rank != types[0].rank for t in types):
        return replicate_only(n, 1)
    g = [
        "_" if (k == d or any(t.shape[k] != types[0].shape[k] for t in types)) else names[k] for k in range(len(names))
    ]
    base = einsum_strategies(einsum_of([g] * n, [g]))
    if op.target in (aten.scatter.value, aten.scatter.src):
        # NOTE: ``self`` sharded along ``dim`` with Replicate index (and src): see backends/local.py.
        base.append(Strategy((Shard(d), *(R for _ in range(n - 1))), (Shard(d),)))
    if op.target == aten.scatter_add.default:
        return with_partials(base, n, 1, [((0, 2), "sum"), ((0, 2), "avg")])
    if op.target == aten.scatter.value:
        kinds: tuple[ReduceOp, ...] = ("avg", "max", "sum") if op_arg(op, "value") == 0 else ("avg", "max")
        return with_partials(base, n, 1, [((0,), k) for k in kinds])
    return base


@RULES.rule(aten.index_select.default)
def index_select(op: Op) -> list[Strategy]:
    """``a _, i -> a i`` for ``index_select(dim=1)``: other dims shard; the index may shard against a
    Replicate ``self``; linear in ``self``."""
    d, names = _along(op)
    self_g = list(names)
    self_g[d] = "_"
    out = list(names)
    out[d] = "i" if "i" not in names else "z"
    base = einsum_strategies(einsum_of([self_g, [out[d]]], [out]))
    return with_partials(base, 2, 1, [((0,), k) for k in ALL_KINDS])


@RULES.rule(aten.topk.default, aten.sort.default, aten.sort.stable)
def order(op: Op) -> list[Strategy]:
    """``a _ -> a _, a _`` (values, indices) along ``dim`` (default -1): the ordered dim stays whole."""
    d, names = _along(op, "dim", -1)
    g = list(names)
    if g:
        g[d] = "_"
    return einsum_strategies(einsum_of([g], [g, g]))


@RULES.rule(aten.cumsum.default)
def cumsum(op: Op) -> list[Strategy]:
    """``a _ -> a _`` along ``dim``: linear, so ``P(sum)``/``P(avg)`` pass. And the scanned dim split:
    each rank scans its part and adds the totals of the ranks before it, which one all-gather of
    every rank's total (its last row: the memory state of linear attention, LASP-2's) brings
    (``backends/context_parallel/split_scans.py``)."""
    d, names = _along(op)
    g = list(names)
    if g:
        g[d] = "_"
    strategies = einsum_strategies(einsum_of([g], [g]), linear=(0,))
    t = tensor_type_of(op.operands[0])
    if t is None or t.rank == 0 or not isinstance(t.shape[d], int) or t.shape[d] <= 1:
        return strategies
    return [*strategies, Strategy((Shard(d),), (Shard(d),), state=nbytes(t) / t.shape[d])]


@RULES.rule(aten.histc.default)
def histc(op: Op) -> list[Strategy]:
    """``a b -> _``: with a fixed range (``min < max``) counts of shards add up, so any shard gives
    ``P(sum)``; the default range comes from the data (global min/max), so then Replicate only."""
    lo, hi = op_arg(op, "min", 0), op_arg(op, "max", 0)
    if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo < hi):
        return replicate_only(1, 1)
    _, names = _along(op)
    return einsum_strategies(einsum_of([names], [["_"]]))
