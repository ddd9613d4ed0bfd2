"""Embedding lookups and their dense backward.

``embedding(weight [V, H], indices [*B]) -> [*B, H]``: the index batch dims shard through to the
result, and so does the hidden dim of the weight. The vocabulary dim would need out-of-range masking
(DTensor's ``_MaskPartial``), which a plain local ``embedding`` does not do, so it stays whole.
"""

from __future__ import annotations

import torch

from meshfold.ir import Op, Partial, R, Shard
from meshfold.passes.sharding.rules.operands import einsum_of, letters, op_arg, tensor_type_of
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies

aten = torch.ops.aten
RULES = RuleSet("embedding")


def _index_letters(op: Op, i: int) -> list[str]:
    t = tensor_type_of(op.operands[i])
    assert t is not None, f"{op.describe()}: indices are not a tensor"
    return letters(t.rank, skip="h")


@RULES.rule(aten.embedding.default)
def embedding(op: Op) -> list[Strategy]:
    """``_ h, a b -> a b h`` (weight, indices -> rows); linear in the weight, so its ``P(sum)``/``P(avg)``
    pass while the indices are Replicate."""
    idx = _index_letters(op, 1)
    out = einsum_strategies(einsum_of([["_", "h"], idx], [[*idx, "h"]]), linear=(0,))
    # NOTE: vocab-parallel: the weight's rows sharded; each rank looks up the ids it holds (masked,
    # see backends/local.py) and the sum over ranks is the whole lookup.
    out.append(Strategy((Shard(0), R), (Partial("sum"),)))
    return out


@RULES.rule(aten.embedding_dense_backward.default)
def embedding_dense_backward(op: Op) -> list[Strategy]:
    """``a b h, a b -> _ h`` (grad_output, indices -> weight grad): a sharded index batch dim gives
    ``P(sum)`` (rows scatter-add), unless ``scale_grad_by_freq`` divides by global counts; linear in
    ``grad_output``. The vocabulary dim (``num_weights``) is never sharded."""
    idx = _index_letters(op, 1)
    grad = [*idx, "h"]
    if op_arg(op, "scale_grad_by_freq", False):
        idx = ["_" for _ in idx]
        grad = [*idx, "h"]
        return einsum_strategies(einsum_of([grad, idx], [["_", "h"]]), linear=(0,))
    out = einsum_strategies(einsum_of([grad, idx], [["_", "h"]]), linear=(0,))
    out.append(Strategy((R, R), (Shard(0),)))  # vocab-parallel rows, see backends/local.py
    return out
