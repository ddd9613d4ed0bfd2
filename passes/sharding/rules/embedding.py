"""Embedding lookups and their dense backward.

``embedding(weight [V, H], indices [*B]) -> [*B, H]``: the index batch dims shard through to the
result, and so does the hidden dim of the weight. The vocabulary dim would need out-of-range masking
(DTensor's ``_MaskPartial``), which a plain local ``embedding`` does not do, so it stays whole.
"""

from __future__ import annotations

from typing import Any

import torch

from meshfold.ir import Op, Partial, R, Shard
from meshfold.passes.sharding.rules.common import einsum_of, letters, op_arg, result_type, tensor_type_of
from meshfold.passes.sharding.rules.registry import RuleSet
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
    # see embedding_ranged) and the sum over ranks is the whole lookup.
    out.append(Strategy((Shard(0), R), (Partial("sum"),)))
    return out


def _in_range(index: torch.Tensor, lo: int, size: int) -> torch.Tensor:
    return (index >= lo) & (index < lo + size)


@RULES.ranged_impl(aten.embedding.default, lambda op: ("operand", 0, 0))
def embedding_ranged(lo: int, size: int, weight: torch.Tensor, indices: torch.Tensor, *rest: Any) -> torch.Tensor:
    """``embedding`` on rows ``[lo, lo + size)`` of the weight: other ids give zero rows."""
    mask = _in_range(indices, lo, size)
    rows: torch.Tensor = aten.embedding.default(weight, torch.where(mask, indices - lo, 0), *rest)
    return rows * mask.unsqueeze(-1).to(rows.dtype)


@RULES.ranged_impl(aten.embedding_dense_backward.default, lambda op: ("result", 0, 0))
def embedding_dense_backward_ranged(
    lo: int, size: int, grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int, scale: bool
) -> torch.Tensor:
    """The weight gradient's rows ``[lo, lo + size)``: gradients of other ids are dropped."""
    mask = _in_range(indices, lo, size)
    local_pad = padding_idx - lo if lo <= padding_idx < lo + size else -1
    masked = grad * mask.unsqueeze(-1).to(grad.dtype)
    out: torch.Tensor = aten.embedding_dense_backward.default(
        masked, torch.where(mask, indices - lo, 0), size, local_pad, scale
    )
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
    out.append(Strategy((R, R), (Shard(0),)))  # vocab-parallel rows, see embedding_dense_backward_ranged
    return out


@RULES.localizer(aten.embedding_dense_backward.default)
def localize_embedding_dense_backward(
    op: Op, local: tuple[tuple[int, ...], ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``num_weights`` is the result's dim 0; it is never sharded, but follow the local shape anyway."""
    args = list(op.args)
    if len(args) > 2 and local and local[0]:
        args[2] = local[0][0]
    assert result_type(op).rank == 2
    return tuple(args), dict(op.kwargs)
