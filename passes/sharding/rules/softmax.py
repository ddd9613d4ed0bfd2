"""Softmax and log-softmax along one dim, with their ``_backward_data`` forms.

The softmax dim needs every element (a normalizer over the whole dim), so it stays whole
(``_``) and is never sharded; every other dim shards alike on all operands.
"""

from __future__ import annotations

import torch

from meshfold.ir import Op
from meshfold.passes.sharding.rules.common import einsum_of, int_arg, letters, norm_dim, result_type
from meshfold.passes.sharding.rules.registry import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies

aten = torch.ops.aten
RULES = RuleSet("softmax")


def _spec(op: Op) -> list[str]:
    t = result_type(op)
    g = letters(t.rank)
    if t.rank:
        g[norm_dim(int_arg(op, "dim", -1), t.rank)] = "_"
    return g


@RULES.rule(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax(op: Op) -> list[Strategy]:
    """``a _ -> a _`` for ``dim=1``: the softmax dim stays whole; not linear, so no Partial."""
    g = _spec(op)
    return einsum_strategies(einsum_of([g], [g]))


@RULES.rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward(op: Op) -> list[Strategy]:
    """``a _, a _ -> a _`` (grad_output, output): softmax dim whole; linear in ``grad_output``
    (``y * (g - sum(g * y))`` and ``g - exp(y) * sum(g)``), so its ``P(sum)``/``P(avg)`` pass."""
    g = _spec(op)
    return einsum_strategies(einsum_of([g, g], [g]), linear=(0,))
