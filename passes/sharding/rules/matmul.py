"""Matrix products: mm, bmm, mv, dot, the bias-adding addmm and baddbmm, and float8's scaled mm."""

from __future__ import annotations

import torch

from meshfold.ir import Op, Partial, Placement, R, Shard, TensorType
from meshfold.passes.sharding.rules.operands import (
    broadcast_groups,
    einsum_of,
    result_type,
    tensor_type_of,
    with_partials,
)
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies

aten = torch.ops.aten
RULES = RuleSet("matmul")


@RULES.rule(aten.mm.default)
def mm(op: Op) -> list[Strategy]:
    """``m k, k n -> m n``: a sharded contraction dim yields Partial(sum)."""
    return einsum_strategies("m k, k n -> m n", linear=(0, 1))


@RULES.rule(aten.bmm.default)
def bmm(op: Op) -> list[Strategy]:
    """``b m k, b k n -> b m n``: batch, rows and columns shard; a sharded ``k`` yields Partial(sum)."""
    return einsum_strategies("b m k, b k n -> b m n", linear=(0, 1))


@RULES.rule(aten.mv.default)
def mv(op: Op) -> list[Strategy]:
    """``m k, k -> m``; linear in each operand."""
    return einsum_strategies("m k, k -> m", linear=(0, 1))


@RULES.rule(aten.dot.default)
def dot(op: Op) -> list[Strategy]:
    """``k, k -> ``: a sharded ``k`` yields Partial(sum); linear in each operand."""
    return einsum_strategies(einsum_of([["k"], ["k"]], [[]]), linear=(0, 1))


def _biased(op: Op, mat: tuple[list[str], list[str], list[str]]) -> list[Strategy]:
    """``beta * bias + alpha * (x @ w)`` with the bias broadcast to the result ``mat[2]``."""
    x, w, out = mat
    # NOTE: broadcast_groups spells the result a, b(, c): the same letters ``mat`` uses.
    bias_g = broadcast_groups(op.operands[:1], result_type(op))[0]
    strategies = [
        s for s in einsum_strategies(einsum_of([bias_g, x, w], [out])) if not isinstance(s.outputs[0], Partial)
    ]
    # NOTE: with ``k`` sharded each rank adds its own part of the bias, so the bias must itself be
    # P(sum) for the ranks' results to sum to ``beta * bias + alpha * x @ w``.
    k_x, k_w = x.index("k"), w.index("k")
    strategies.append(Strategy((Partial("sum"), Shard(k_x), Shard(k_w)), (Partial("sum"),)))
    return with_partials(strategies, 3, 1, [((0, 1), "sum"), ((0, 1), "avg"), ((0, 2), "sum"), ((0, 2), "avg")])


@RULES.rule(aten.addmm.default)
def addmm(op: Op) -> list[Strategy]:
    """``n, m k, k n -> m n`` (bias ``[n]`` or ``[m, n]``): rows/columns shard with the bias; a sharded
    ``k`` needs a ``P(sum)`` bias; bias and one factor Partial together (the other Replicate) pass."""
    return _biased(op, (["a", "k"], ["k", "b"], ["a", "b"]))


@RULES.rule(aten.baddbmm.default)
def baddbmm(op: Op) -> list[Strategy]:
    """``b m n, b m k, b k n -> b m n`` (bias broadcast): like :func:`addmm` with a batch dim."""
    return _biased(op, (["a", "b", "k"], ["a", "k", "c"], ["a", "b", "c"]))


@RULES.rule(aten._scaled_mm.default)
def scaled_mm(op: Op) -> list[Strategy]:
    """``_scaled_mm(a, b, scale_a, scale_b, bias?, scale_result?, out_dtype, fast_accum)``: float8
    ``m k, k n -> m n`` (the dequantized product ``(a @ b) * scale_a * scale_b``), so ``mm``'s
    strategies with each scale beside its factor: a tensorwise (0-d) scale Replicate, a rowwise one
    (``[m, 1]`` for ``a``, ``[1, n]`` for ``b``) sharded where its factor's ``m`` or ``n`` is. A
    sharded ``k`` yields Partial(sum): the scales do not depend on ``k``'s shard (the amax they
    come from is reduced over every rank first). An op with a bias or a result scale keeps mm's
    strategies that leave the result whole (``k`` unsharded)."""
    sa, sb = (tensor_type_of(v) for v in op.operands[2:4])
    assert sa is not None and sb is not None
    extra = len(op.operands) - 4
    plain = einsum_strategies("m k, k n -> m n", linear=(0, 1))
    out: list[Strategy] = []
    for s in plain:
        pa, pb = s.inputs
        if extra and (isinstance(s.outputs[0], Partial) or pb != R):  # NOTE: the bias is [n], left whole
            continue
        placed = (_scale_beside(pa, sa, 0), _scale_beside(pb, sb, 1))
        if None in placed:
            continue
        out.append(Strategy((pa, pb, *placed, *([R] * extra)), s.outputs))  # type: ignore[arg-type]
    return list(dict.fromkeys(out))


def _scale_beside(factor: Placement, scale: TensorType, dim: int) -> Placement | None:
    """The placement of a scale beside its factor's: ``dim`` is the factor's kept dim (``a``'s rows,
    0; ``b``'s columns, 1), the one a rowwise scale runs along; None when the scale cannot follow."""
    rowwise = scale.rank == 2 and scale.shape[dim] != 1
    if isinstance(factor, Shard) and factor.dim == dim:
        return Shard(dim) if rowwise else (R if scale.rank == 0 or all(d == 1 for d in scale.shape) else None)
    return R
