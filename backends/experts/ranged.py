"""A rank's share of sharded routed experts as one op: ``meshfold::moe_experts_range`` and its backward.

With the experts' dim sharded and the tokens replicated (the all-gather dispatcher,
``passes/sharding/rules/routed_experts.py``), a rank computes the tokens routed to its experts
``[lo, lo + n)`` and leaves every other row zero (``ir.dialects.moe.experts_range``). Grouping tokens by
expert has shapes known only while it runs, so a compiler that traces the rank's program (Inductor)
must see the share as one op, tokens in and tokens out: these custom ops, with fake kernels that
give their results' shapes. ``backends/local.py``'s ranged implementations of the experts ops call
them.
"""

from __future__ import annotations

import torch

from meshfold.ir.dialects.moe import experts_range, experts_range_backward


@torch.library.custom_op("meshfold::moe_experts_range", mutates_args=())
def moe_experts_range(
    lo: int,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    capacity: int,
    policy: str,
    dispatcher: str,
    rows: int = 0,
) -> torch.Tensor:
    """``moe_experts`` computed by experts ``[lo, lo + len(w_down))`` only (:func:`experts_range`)."""
    return experts_range(lo, hidden, top_k_index, top_k_weights, w_gate_up, w_down, act, capacity, policy, rows=rows)


@moe_experts_range.register_fake
def _moe_experts_range_fake(lo: int, hidden: torch.Tensor, *rest: object, rows: int = 0) -> torch.Tensor:
    return torch.empty_like(hidden)


@torch.library.custom_op("meshfold::moe_experts_range_backward", mutates_args=())
def moe_experts_range_backward(
    lo: int,
    grad: torch.Tensor,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    capacity: int,
    policy: str,
    dispatcher: str,
    rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``moe_experts_range`` w.r.t. hidden, top_k_weights, w_gate_up and w_down
    (:func:`experts_range_backward`)."""
    return experts_range_backward(
        lo, grad, hidden, top_k_index, top_k_weights, w_gate_up, w_down, act, capacity, policy, rows=rows
    )


@moe_experts_range_backward.register_fake
def _moe_experts_range_backward_fake(
    lo: int,
    grad: torch.Tensor,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *options: object,
    rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(hidden),
        torch.empty_like(top_k_weights),
        torch.empty_like(w_gate_up),
        torch.empty_like(w_down),
    )


EXPERTS_RANGE = torch.ops.meshfold.moe_experts_range.default
EXPERTS_RANGE_BACKWARD = torch.ops.meshfold.moe_experts_range_backward.default
