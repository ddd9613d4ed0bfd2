"""Shape and data-movement ops: views and reshapes, expand, permutations, (un)squeeze, slicing and
selecting (with their backward forms), cat/stack, split/unbind, padding, repeat and flip.

None of them computes, so every Partial kind passes from the data operand to the results.
"""

from __future__ import annotations

import torch

from meshfold.ir import Op, Shard
from meshfold.ir.placement import ReduceOp
from meshfold.passes.sharding.cost import nbytes
from meshfold.passes.sharding.rules.operands import (
    einsum_of,
    int_arg,
    letters,
    movement,
    norm_dim,
    op_arg,
    result_type,
    tensor_type_of,
    view_dim_map,
    with_partials,
)
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies, replicate_only

aten = torch.ops.aten
RULES = RuleSet("shape")
ALL_KINDS: tuple[ReduceOp, ...] = ("sum", "avg", "max")


def _src(op: Op, i: int = 0) -> list[str]:
    t = tensor_type_of(op.operands[i])
    assert t is not None, f"{op.describe()}: operand {i} is not a tensor"
    return letters(t.rank)


def _dims(value: object, rank: int) -> list[int]:
    items = value if isinstance(value, tuple) else (value,)
    return [norm_dim(d, rank) for d in items if isinstance(d, int)]


@RULES.rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)
def view(op: Op) -> list[Strategy]:
    """``a _ -> a`` for ``[6, 4] -> [24]``, ``a _ c -> a c`` for ``[2, 3, 4] -> [6, 4]``: dims group by
    equal size products and only the outermost dim of a group keeps its shard (see ``view_dim_map``)."""
    src_t = tensor_type_of(op.operands[0])
    assert src_t is not None
    dst = result_type(op)
    names = letters(src_t.rank)
    mapping = view_dim_map(src_t.shape, dst.shape)
    ins = [names[d] if d in mapping else "_" for d in range(src_t.rank)]
    out = ["_"] * dst.rank
    for d, e in mapping.items():
        out[e] = names[d]
    return movement(einsum_of([ins], [out]))


@RULES.rule(aten.expand.default, aten.expand_copy.default)
def expand(op: Op) -> list[Strategy]:
    """``_ b -> a c b``: kept dims shard alike; broadcast (size-1) and new leading dims stay whole."""
    src_t = tensor_type_of(op.operands[0])
    assert src_t is not None
    dst = result_type(op)
    names = letters(dst.rank)
    offset = dst.rank - src_t.rank
    ins = [names[d + offset] if src_t.shape[d] == dst.shape[d + offset] else "_" for d in range(src_t.rank)]
    out = [names[e] if e >= offset and ins[e - offset] != "_" else "_" for e in range(dst.rank)]
    return movement(einsum_of([ins], [out]))


@RULES.rule(aten.permute.default)
def permute(op: Op) -> list[Strategy]:
    """``a b c -> c a b`` for ``dims = (2, 0, 1)``."""
    names = _src(op)
    order = _dims(op_arg(op, "dims"), len(names))
    return movement(einsum_of([names], [[names[d] for d in order]]))


@RULES.rule(aten.t.default)
def t(op: Op) -> list[Strategy]:
    """``a b -> b a`` (1-D and 0-D: identity)."""
    names = _src(op)
    return movement(einsum_of([names], [names[::-1]]))


@RULES.rule(aten.transpose.int)
def transpose(op: Op) -> list[Strategy]:
    """``a b c -> a c b`` for ``transpose(1, 2)``."""
    names = _src(op)
    rank = len(names)
    d0, d1 = norm_dim(int_arg(op, "dim0", 0), rank), norm_dim(int_arg(op, "dim1", 0), rank)
    out = list(names)
    if rank:
        out[d0], out[d1] = names[d1], names[d0]
    return movement(einsum_of([names], [out]))


@RULES.rule(aten.unsqueeze.default)
def unsqueeze(op: Op) -> list[Strategy]:
    """``a b -> a _ b`` for ``unsqueeze(1)``."""
    names = _src(op)
    d = norm_dim(int_arg(op, "dim", 0), len(names) + 1)
    return movement(einsum_of([names], [[*names[:d], "_", *names[d:]]]))


@RULES.rule(aten.squeeze.dim, aten.squeeze.dims)
def squeeze(op: Op) -> list[Strategy]:
    """``a _ b -> a b`` for ``squeeze(1)``. NOTE: a listed dim whose global size is not 1 is a no-op
    globally but would be squeezed on a rank holding one row of it, so it is never sharded."""
    src_t = tensor_type_of(op.operands[0])
    assert src_t is not None
    names = letters(src_t.rank)
    listed = set(_dims(op_arg(op, "dim"), max(src_t.rank, 1)))
    ins = ["_" if d in listed else names[d] for d in range(src_t.rank)]
    out = [ins[d] for d in range(src_t.rank) if not (d in listed and src_t.shape[d] == 1)]
    return movement(einsum_of([ins], [out]))


@RULES.rule(aten.squeeze.default)
def squeeze_all(op: Op) -> list[Strategy]:
    """``_ _ -> _``: squeezes every size-1 dim, and a sharded dim may be size 1 on a rank, so no dim
    is sharded; Partials pass."""
    src_t = tensor_type_of(op.operands[0])
    assert src_t is not None
    out = ["_" for s in src_t.shape if s != 1]
    return movement(einsum_of([["_"] * src_t.rank], [out]))


def _whole_slice(op: Op, size: object) -> bool:
    start, end, step = op_arg(op, "start"), op_arg(op, "end"), op_arg(op, "step", 1)
    full_end = end is None or (isinstance(end, int) and isinstance(size, int) and end >= size)
    return start in (None, 0) and full_end and step == 1


@RULES.rule(aten.slice.Tensor)
def slice_(op: Op) -> list[Strategy]:
    """``a _ c -> a _ c`` for ``slice(dim=1)``: the sliced dim stays whole (its bounds are global),
    unless the slice takes all of it with step 1."""
    src_t = tensor_type_of(op.operands[0])
    assert src_t is not None
    names = letters(src_t.rank)
    d = norm_dim(int_arg(op, "dim", 0), src_t.rank)
    g = list(names)
    if not _whole_slice(op, src_t.shape[d]):
        g[d] = "_"
    return movement(einsum_of([g], [g]))


@RULES.rule(aten.slice_backward.default)
def slice_backward(op: Op) -> list[Strategy]:
    """``a _ c -> a _ c`` for ``dim=1``: zero-padding back to ``input_sizes`` (sliced dim whole);
    the padding is 0 on every rank, so every Partial kind passes."""
    names = _src(op)
    g = list(names)
    g[norm_dim(int_arg(op, "dim", 0), len(names))] = "_"
    return movement(einsum_of([g], [g]))


@RULES.rule(aten.select.int)
def select(op: Op) -> list[Strategy]:
    """``a _ c -> a c`` for ``select(dim=1, index)``."""
    names = _src(op)
    d = norm_dim(int_arg(op, "dim", 0), len(names))
    g = list(names)
    g[d] = "_"
    return movement(einsum_of([g], [[*names[:d], *names[d + 1 :]]]))


@RULES.rule(aten.select_backward.default)
def select_backward(op: Op) -> list[Strategy]:
    """``a c -> a _ c`` for ``dim=1``: the gradient written into zeros of ``input_sizes``."""
    out_t = result_type(op)
    names = letters(out_t.rank)
    d = norm_dim(int_arg(op, "dim", 0), out_t.rank)
    out = list(names)
    out[d] = "_"
    return movement(einsum_of([[*names[:d], *names[d + 1 :]]], [out]))


def _list_notation(op: Op, dim: int, *, new_dim: bool) -> list[Strategy]:
    """Shared by cat and stack: every input spelled alike with ``dim`` whole (cat) or inserted (stack)."""
    types = [tensor_type_of(v) for v in op.operands]
    n = len(types)
    ranks = {t.rank for t in types if t is not None}
    out_t = result_type(op)
    if len(ranks) != 1 or any(t is None for t in types):
        return replicate_only(n, 1)
    names = letters(out_t.rank)
    d = norm_dim(dim, out_t.rank)
    ins = [*names[:d], *names[d + 1 :]] if new_dim else [*names[:d], "_", *names[d + 1 :]]
    out = [*names[:d], "_", *names[d + 1 :]]
    base = einsum_strategies(einsum_of([ins for _ in types], [out]))
    return with_partials(base, n, 1, [(tuple(range(n)), k) for k in ALL_KINDS])


@RULES.rule(aten.cat.default)
def cat(op: Op) -> list[Strategy]:
    """``a _, a _ -> a _`` for ``cat(dim=1)``: other dims shard on every input; all-Partial adds up."""
    return _list_notation(op, int_arg(op, "dim", 0), new_dim=False)


@RULES.rule(aten.stack.default)
def stack(op: Op) -> list[Strategy]:
    """``a c, a c -> a _ c`` for ``stack(dim=1)``."""
    return _list_notation(op, int_arg(op, "dim", 0), new_dim=True)


@RULES.rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def split(op: Op) -> list[Strategy]:
    """``a _ -> a _, a _`` for ``split(dim=1)`` (``unbind``: ``a _ -> a, a``); sizes are along the
    whole split dim."""
    names = _src(op)
    d = norm_dim(int_arg(op, "dim", 0), len(names))
    g = list(names)
    g[d] = "_"
    out = g if op.target != aten.unbind.int else [*names[:d], *names[d + 1 :]]
    return movement(einsum_of([g], [out for _ in op.results]))


@RULES.rule(aten.constant_pad_nd.default)
def constant_pad_nd(op: Op) -> list[Strategy]:
    """``a _ -> a _`` for a pad of the last dim: padded dims stay whole; ``P(avg)``/``P(max)`` pass
    (every rank pads with the same value), ``P(sum)`` only for a zero pad."""
    names = _src(op)
    pad = op_arg(op, "pad", ())
    pads = pad if isinstance(pad, tuple) else ()
    g = list(names)
    for k in range(0, len(pads) - 1, 2):
        if pads[k] != 0 or pads[k + 1] != 0:
            g[len(names) - 1 - k // 2] = "_"
    kinds: tuple[ReduceOp, ...] = ("avg", "max", "sum") if op_arg(op, "value", 0) == 0 else ("avg", "max")
    return with_partials(einsum_strategies(einsum_of([g], [g])), 1, 1, [((0,), k) for k in kinds])


@RULES.rule(aten.repeat.default)
def repeat(op: Op) -> list[Strategy]:
    """``_ b -> _ _ b`` for ``repeats = (2, 3, 1)``: only dims repeated once keep their shard."""
    names = _src(op)
    out_t = result_type(op)
    reps = op_arg(op, "repeats", ())
    reps_t = reps if isinstance(reps, tuple) else ()
    offset = out_t.rank - len(names)
    ins = [names[d] if d + offset < len(reps_t) and reps_t[d + offset] == 1 else "_" for d in range(len(names))]
    out = ["_"] * offset + ins
    return movement(einsum_of([ins], [out]))


@RULES.rule(aten.flip.default)
def flip(op: Op) -> list[Strategy]:
    """``a _ -> a _`` for ``flip(dims=[1])``; and a flipped dim split: each rank flips its part and
    swaps it with the rank mirroring it (``backends/context_parallel/split_scans.py``; a reversed running sum is a
    flip, a
    running sum and a flip)."""
    names = _src(op)
    flipped = set(_dims(op_arg(op, "dims"), max(len(names), 1)))
    g = ["_" if d in flipped else names[d] for d in range(len(names))]
    strategies = movement(einsum_of([g], [g]))
    t = tensor_type_of(op.operands[0])
    if t is None:
        return strategies
    return [*strategies, *(Strategy((Shard(d),), (Shard(d),), exchange=nbytes(t)) for d in sorted(flipped))]
