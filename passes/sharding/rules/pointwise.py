"""Elementwise ops with broadcasting: unary math, activations and their backward forms, binary
arithmetic, comparisons and bitwise ops, ``where``/``masked_fill``, casts and copies.

Every rule spells the op with :func:`broadcast_einsum` (dims align from the right; a size-1 operand
dim under a larger result dim stays whole) and adds the Partial placements the op is exact for.
"""

from __future__ import annotations

import torch

from meshfold.ir import Op
from meshfold.ir.dialects.stage import MARKS
from meshfold.ir.placement import ReduceOp
from meshfold.passes.sharding.rules.operands import broadcast_einsum, is_float, op_arg, tensor_type_of, with_partials
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies

aten = torch.ops.aten
RULES = RuleSet("pointwise")

# NOTE: P(max) may pass through f only when f is non-decreasing on ALL reals (max_r f(a_r) = f(max_r a_r)
# for any values the ranks hold); log/sqrt are monotone but not total, so they are plain.
MONOTONE = (
    aten.exp.default,
    aten.exp2.default,
    aten.expm1.default,
    aten.relu.default,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.atan.default,
    aten.asinh.default,
    aten.sinh.default,
    aten.erf.default,
    aten.floor.default,
    aten.ceil.default,
    aten.trunc.default,
    aten.round.default,
    aten.clamp.default,
    aten.clamp_min.default,
    aten.clamp_max.default,
    aten.hardtanh.default,
    aten.hardsigmoid.default,
)

PLAIN = (
    aten.abs.default,
    aten.acos.default,
    aten.acosh.default,
    aten.asin.default,
    aten.atanh.default,
    aten.cos.default,
    aten.cosh.default,
    aten.erfc.default,
    aten.erfinv.default,
    aten.frac.default,
    aten.log.default,
    aten.log10.default,
    aten.log1p.default,
    aten.log2.default,
    aten.logical_not.default,
    aten.bitwise_not.default,
    aten.reciprocal.default,
    aten.rsqrt.default,
    aten.sign.default,
    aten.sgn.default,
    aten.signbit.default,
    aten.sin.default,
    aten.sqrt.default,
    aten.tan.default,
    aten.isnan.default,
    aten.isinf.default,
    aten.gelu.default,
    aten.silu.default,
    aten.mish.default,
    aten.hardswish.default,
    aten.elu.default,
    aten.leaky_relu.default,
    aten.softplus.default,
    aten.threshold.default,
    aten.nan_to_num.default,
    aten.logit.default,
    aten.square.default,
    aten.pow.Tensor_Scalar,
    aten.pow.Scalar,
    aten.pow.Tensor_Tensor,
    aten.eq.Scalar,
    aten.ne.Scalar,
    aten.lt.Scalar,
    aten.le.Scalar,
    aten.gt.Scalar,
    aten.ge.Scalar,
    aten.eq.Tensor,
    aten.ne.Tensor,
    aten.lt.Tensor,
    aten.le.Tensor,
    aten.gt.Tensor,
    aten.ge.Tensor,
    aten.bitwise_and.Scalar,
    aten.bitwise_or.Scalar,
    aten.bitwise_xor.Scalar,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.bitwise_xor.Tensor,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.logical_xor.default,
    aten.remainder.Scalar,
    aten.remainder.Tensor,
    aten.fmod.Scalar,
    aten.fmod.Tensor,
    aten.floor_divide.default,
    aten.div.Tensor_mode,
    aten.div.Scalar_mode,
    aten.rsub.Scalar,
    aten.rsub.Tensor,
    aten.minimum.default,
    aten.clamp.Tensor,
    aten.clamp_min.Tensor,
    aten.clamp_max.Tensor,
    aten.lerp.Scalar,
    aten.lerp.Tensor,
    aten.addcmul.default,
    aten.addcdiv.default,
)

COPIES = (
    *MARKS,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten._to_copy.default,
    aten.lift_fresh_copy.default,
    aten.contiguous.default,
    aten.positive.default,
)

GRAD_FIRST = (
    aten.gelu_backward.default,
    aten.silu_backward.default,
    aten.threshold_backward.default,
    aten.sigmoid_backward.default,
    aten.tanh_backward.default,
    aten.hardtanh_backward.default,
    aten.hardsigmoid_backward.default,
    aten.hardswish_backward.default,
    aten.leaky_relu_backward.default,
    aten.softplus_backward.default,
    aten.elu_backward.default,
    aten.mish_backward.default,
)


def _shards(op: Op) -> list[Strategy]:
    return einsum_strategies(broadcast_einsum(op))


def _float_operands(op: Op, among: range | tuple[int, ...]) -> list[int]:
    return [i for i in among if i < len(op.operands) and is_float(tensor_type_of(op.operands[i]))]


@RULES.rule(*PLAIN)
def plain(op: Op) -> list[Strategy]:
    """Broadcast notation (``a b, b -> a b``); nonlinear, so no Partial passes."""
    return _shards(op)


@RULES.rule(*MONOTONE)
def monotone(op: Op) -> list[Strategy]:
    """Broadcast notation; a non-decreasing total function also maps ``P(max) -> P(max)``."""
    n = len(op.operands)
    return with_partials(_shards(op), n, len(op.results), [((0,), "max")] if n == 1 else [])


@RULES.rule(*COPIES)
def copy(op: Op) -> list[Strategy]:
    """``a b -> a b``; a copy (or a float-to-float cast) passes every Partial kind through."""
    return with_partials(_shards(op), 1, 1, [((0,), "sum"), ((0,), "avg"), ((0,), "max")])


@RULES.rule(aten.neg.default, aten.mul.Scalar, aten.div.Scalar)
def scale(op: Op) -> list[Strategy]:
    """``a b -> a b``; linear, so ``P(sum)`` and ``P(avg)`` pass (not ``P(max)``: the scale may be negative)."""
    return with_partials(_shards(op), 1, 1, [((0,), "sum"), ((0,), "avg")])


@RULES.rule(aten.add.Scalar, aten.sub.Scalar)
def shift(op: Op) -> list[Strategy]:
    """``a b -> a b``; adding a constant keeps averages and maxima, not sums."""
    return with_partials(_shards(op), 1, 1, [((0,), "avg"), ((0,), "max")])


@RULES.rule(aten.mul.Tensor)
def mul(op: Op) -> list[Strategy]:
    """Broadcast notation; linear in each operand while the other is Replicate."""
    n = len(op.operands)
    pairs: list[tuple[tuple[int, ...], ReduceOp]] = [
        ((i,), k) for i in _float_operands(op, range(n)) for k in ("sum", "avg")
    ]
    return with_partials(_shards(op), n, 1, pairs)


@RULES.rule(aten.div.Tensor)
def div(op: Op) -> list[Strategy]:
    """Broadcast notation; linear in the dividend while the divisor is Replicate."""
    return with_partials(_shards(op), len(op.operands), 1, [((0,), "sum"), ((0,), "avg")])


@RULES.rule(aten.add.Tensor, aten.sub.Tensor)
def add(op: Op) -> list[Strategy]:
    """Broadcast notation; all-Partial sums/averages add up, and one Partial(avg)/P(max) term plus a
    Replicate one stays exact (``mean_r(a_r + b) = A + b``; ``P(max)`` only on the first term,
    whose sign ``alpha`` never flips)."""
    n = len(op.operands)
    if n == 1:
        return with_partials(_shards(op), 1, 1, [((0,), "avg"), ((0,), "max")])
    pairs: list[tuple[tuple[int, ...], ReduceOp]] = [
        ((0, 1), "sum"),
        ((0, 1), "avg"),
        ((0,), "avg"),
        ((1,), "avg"),
        ((0,), "max"),
    ]
    return with_partials(_shards(op), n, 1, pairs)


@RULES.rule(aten.maximum.default)
def maximum(op: Op) -> list[Strategy]:
    """Broadcast notation; ``max(P(max), P(max)) = P(max)``."""
    return with_partials(_shards(op), 2, 1, [((0, 1), "max")])


@RULES.rule(*GRAD_FIRST)
def grad_first(op: Op) -> list[Strategy]:
    """``a b, a b -> a b`` for ``grad * f'(x)``: linear in the incoming gradient (operand 0)."""
    return with_partials(_shards(op), len(op.operands), 1, [((0,), "sum"), ((0,), "avg")])


@RULES.rule(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
def where(op: Op) -> list[Strategy]:
    """``c a b, a b, b -> a b`` (broadcast). With a Replicate condition ``where`` is linear in its
    branches jointly (both Partial of one kind), and one Partial(avg)/P(max) branch beside a
    Replicate (or Python scalar) branch stays exact: ``mean_r where(c, a_r, b) = where(c, A, b)``."""
    n = len(op.operands)
    branches = tuple(_float_operands(op, range(1, n)))
    pairs: list[tuple[tuple[int, ...], ReduceOp]] = [((b,), k) for b in branches for k in ("avg", "max")]
    if len(branches) == 2:
        pairs += [(branches, "sum"), (branches, "avg"), (branches, "max")]
    return with_partials(_shards(op), n, 1, pairs)


@RULES.rule(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(op: Op) -> list[Strategy]:
    """``a b, b -> a b``; filling keeps averages and maxima of ``self``, and sums when the fill is 0."""
    n = len(op.operands)
    pairs: list[tuple[tuple[int, ...], ReduceOp]] = [((0,), "avg"), ((0,), "max")]
    if op_arg(op, "value") == 0 and n == 2:
        pairs.append(((0,), "sum"))
    return with_partials(_shards(op), n, 1, pairs)
