"""Matrix products: mm, bmm, mv, dot, and the bias-adding addmm and baddbmm."""

from __future__ import annotations

import torch

from meshfold.ir import Op, Partial, Shard
from meshfold.passes.sharding.rules.operands import broadcast_groups, einsum_of, result_type, with_partials
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
