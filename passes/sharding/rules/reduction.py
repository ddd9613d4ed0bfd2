"""Reductions over dims: sum, mean, amax/amin, max/min, argmax/argmin, prod, var/std, any/all,
logsumexp, with and without ``keepdim``.

The notation keeps every dim's letter in the input; a reduced dim disappears from the result (or
becomes ``_`` with ``keepdim``), so sharding it gives ``Partial(reduce)``. Reductions that have no
exact partial form (``prod``, ``var``, ``argmax``, ...) mark the reduced dims ``_`` instead.
"""

from __future__ import annotations

import torch

from meshfold.ir import Op
from meshfold.ir.placement import ReduceOp
from meshfold.passes.sharding.rules.operands import dims_arg, einsum_of, letters, op_arg, tensor_type_of, with_partials
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies

aten = torch.ops.aten
RULES = RuleSet("reduction")


def _notation(op: Op, dims_name: str | None, *, shardable: bool) -> tuple[list[str], list[str]]:
    """Input letters and result letters of a reduction of ``op.operands[0]``."""
    t = tensor_type_of(op.operands[0])
    assert t is not None, f"{op.describe()}: reduction of a non-tensor"
    names = letters(t.rank)
    reduced = dims_arg(op, dims_name, t.rank) if dims_name is not None else list(range(t.rank))
    keepdim = bool(op_arg(op, "keepdim", False))
    src = [("_" if (d in reduced and not shardable) else names[d]) for d in range(t.rank)]
    out = [("_" if d in reduced else names[d]) for d in range(t.rank) if keepdim or d not in reduced]
    return src, out


def _reduce(op: Op, dims_name: str | None, kind: ReduceOp | None, linear: tuple[ReduceOp, ...]) -> list[Strategy]:
    src, out = _notation(op, dims_name, shardable=kind is not None)
    n_out = len(op.results)
    e = einsum_of([src], [out for _ in range(n_out)])
    base = einsum_strategies(e, reduce=kind or "sum")
    return with_partials(base, 1, n_out, [((0,), k) for k in linear])


@RULES.rule(aten.sum.default, aten.nansum.default)
def sum_all(op: Op) -> list[Strategy]:
    """``a b -> ``: any shard gives ``P(sum)``; linear, so ``P(sum)``/``P(avg)`` pass."""
    return _reduce(op, None, "sum", ("sum", "avg"))


@RULES.rule(aten.sum.dim_IntList)
def sum_dims(op: Op) -> list[Strategy]:
    """``a b c -> a c`` (``keepdim``: ``a _ c``) over ``dim``; a reduced shard gives ``P(sum)``."""
    return _reduce(op, "dim", "sum", ("sum", "avg"))


@RULES.rule(aten.mean.default)
def mean_all(op: Op) -> list[Strategy]:
    """``a b -> ``: an even shard gives ``P(avg)`` (the caller only shards dims the axis divides)."""
    return _reduce(op, None, "avg", ("sum", "avg"))


@RULES.rule(aten.mean.dim)
def mean_dims(op: Op) -> list[Strategy]:
    """``a b c -> a c`` over ``dim``; a reduced (evenly) sharded dim gives ``P(avg)``."""
    return _reduce(op, "dim", "avg", ("sum", "avg"))


@RULES.rule(aten.amax.default)
def amax(op: Op) -> list[Strategy]:
    """``a b c -> a c`` over ``dim``; a reduced shard gives ``P(max)``, and ``P(max)`` passes."""
    return _reduce(op, "dim", "max", ("max",))


@RULES.rule(aten.max.default)
def max_all(op: Op) -> list[Strategy]:
    """``a b -> ``: any shard gives ``P(max)``, and ``P(max)`` passes."""
    return _reduce(op, None, "max", ("max",))


@RULES.rule(aten.amin.default, aten.prod.dim_int, aten.logsumexp.default)
def reduce_dims_whole(op: Op) -> list[Strategy]:
    """``a _ c -> a c`` over ``dim``: no exact partial form (there is no ``P(min)``; products and
    log-sum-exps of parts are not sums), so reduced dims stay whole."""
    return _reduce(op, "dim", None, ())


@RULES.rule(aten.min.default, aten.prod.default)
def reduce_all_whole(op: Op) -> list[Strategy]:
    """``_ _ -> ``: a full reduction with no exact partial form; Replicate only."""
    return _reduce(op, None, None, ())


@RULES.rule(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
def index_reduce(op: Op) -> list[Strategy]:
    """``a _ c -> a c, a c`` over ``dim``: values and indices (indices are positions in the whole
    dim, so it stays whole); ``dim=None`` (argmax of the flattened tensor) keeps every dim whole."""
    if op_arg(op, "dim") is None:
        return _reduce(op, None, None, ())
    return _reduce(op, "dim", None, ())


@RULES.rule(
    aten.var.correction,
    aten.std.correction,
    aten.var_mean.correction,
    aten.any.dim,
    aten.any.dims,
    aten.all.dim,
    aten.all.dims,
)
def moments(op: Op) -> list[Strategy]:
    """``a _ c -> a c`` over ``dim``: variance and boolean reductions are not sums of parts."""
    return _reduce(op, "dim", None, ())


@RULES.rule(aten.any.default, aten.all.default)
def bool_all(op: Op) -> list[Strategy]:
    """``_ _ -> ``: Replicate only (there is no ``P(or)``)."""
    return _reduce(op, None, None, ())
