"""Routed experts (``meshfold.moe_experts`` and its backward; see ``ir.moe``).

``moe_experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k], w_gate_up [E, 2I, H],
w_down [E, H, I]) -> [T, H]`` is token-parallel: each token's output needs only its own row, its
routing and the weights. Expert parallelism is the weights' expert dim sharded: every rank computes
the tokens routed to its own experts (``experts_range``) and leaves the other rows zero, so the
result is ``P(sum)``; with tokens replicated on that axis this is the all-gather dispatcher (the
tokens are gathered before and the result reduce-scattered after, by boxing). Both compose over
different mesh axes: tokens split over one, experts over another.
"""

from __future__ import annotations

from typing import Any

import torch

from ir import Op, Partial, R, Shard
from ir.moe import EXPERTS, EXPERTS_BACKWARD, experts_range, experts_range_backward
from passes.sharding.rules.registry import RuleSet
from passes.sharding.strategy import Strategy

RULES = RuleSet("moe")
S0, P = Shard(0), Partial("sum")


@RULES.rule(EXPERTS)
def moe_experts(op: Op) -> list[Strategy]:
    """(hidden, index, weights, w_gate_up, w_down) -> out."""
    return [
        Strategy((R, R, R, R, R), (R,)),
        Strategy((S0, S0, S0, R, R), (S0,)),  # tokens split: each rank routes and computes its own
        Strategy((R, R, R, S0, S0), (P,)),  # experts split: each rank computes its experts' tokens
        Strategy((R, R, P, R, R), (P,)),  # linear in the routing weights
    ]


@RULES.rule(EXPERTS_BACKWARD)
def moe_experts_backward(op: Op) -> list[Strategy]:
    """(grad, hidden, index, weights, w_gate_up, w_down) -> (d_hidden, d_weights, d_gate_up, d_down)."""
    return [
        Strategy((R, R, R, R, R, R), (R, R, R, R)),
        Strategy((S0, S0, S0, S0, R, R), (S0, S0, P, P)),
        Strategy((R, R, R, R, S0, S0), (P, P, S0, S0)),
        Strategy((P, R, R, R, R, R), (P, P, P, P)),  # linear in the incoming gradient
    ]


@RULES.ranged_impl(EXPERTS, lambda op: ("operand", 3, 0))
def moe_experts_ranged(lo: int, size: int, *args: Any) -> torch.Tensor:
    """This rank's experts ``[lo, lo + size)`` only (its slice of the weights)."""
    return experts_range(lo, *args)


@RULES.ranged_impl(EXPERTS_BACKWARD, lambda op: ("operand", 4, 0))
def moe_experts_backward_ranged(lo: int, size: int, *args: Any) -> tuple[torch.Tensor, ...]:
    return experts_range_backward(lo, *args)
