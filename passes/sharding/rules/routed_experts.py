"""Routed experts (``meshfold.moe_experts`` and its backward; see ``ir.dialects.moe``).

``moe_experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k], w_gate_up [E, 2, I, H],
w_down [E, H, I]) -> [T, H]`` is token-parallel: each token's output needs only its own row, its
routing and the weights. Expert parallelism is the weights' expert dim sharded: every rank computes
the tokens routed to its own experts (``experts_range``) and leaves the other rows zero, so the
result is ``P(sum)``; with tokens replicated on that axis this is the all-gather dispatcher (the
tokens are gathered before and the result reduce-scattered after, by boxing). With tokens AND
experts split over one axis, the op itself exchanges token rows among that axis's ranks: the
all-to-all dispatcher (``backends/experts/dispatch.py``; its traffic is the strategy's ``exchange``). These
compose over different mesh axes. Expert tensor parallelism splits every expert's intermediate dim
(both weights on ``I``): partial outputs, ``P(sum)``. The op's ``dispatcher`` argument narrows the
choice; a capacity (token dropping, judged over the whole batch) rules out splitting tokens without
an exchange.
"""

from __future__ import annotations

from meshfold.ir import Op, Partial, R, Shard, TensorType
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy

RULES = RuleSet("moe")
S0, S2, P = Shard(0), Shard(2), Partial("sum")


def _options(op: Op, first: int) -> tuple[int, str]:
    """(capacity, dispatcher) from the op's arguments after its tensors (see ``ir.dialects.moe``)."""
    capacity, dispatcher = op.args[first + 1], op.args[first + 3]
    assert isinstance(capacity, int) and isinstance(dispatcher, str), f"{op.describe()}: malformed arguments"
    return capacity, dispatcher


def _exchanged(op: Op, trips: int) -> float:
    """Bytes of token rows the all-to-all dispatcher moves for this op, all tokens counted once per trip."""
    hidden, idx = op.operands[-5].type, op.operands[-4].type
    assert isinstance(hidden, TensorType) and isinstance(idx, TensorType)
    return float(int(idx.shape[0]) * int(idx.shape[1]) * int(hidden.shape[1]) * hidden.dtype.itemsize * trips)


@RULES.rule(EXPERTS)
def moe_experts(op: Op) -> list[Strategy]:
    """(hidden, index, weights, w_gate_up, w_down) -> out."""
    capacity, dispatcher = _options(op, 5)
    out = [Strategy((R, R, R, R, R), (R,))]
    if capacity == 0:
        # NOTE: tokens split, experts whole: each rank routes and computes its own tokens; with a
        # capacity the drops are judged over the whole batch, so tokens may not be split this way.
        out.append(Strategy((S0, S0, S0, R, R), (S0,)))
        out.append(Strategy((R, R, P, R, R), (P,)))  # linear in the routing weights
    out.append(Strategy((R, R, R, S2, S2), (P,)))  # expert tensor parallel: each rank a slice of I
    if dispatcher in ("any", "allgather"):
        out.append(Strategy((R, R, R, S0, S0), (P,)))  # all-gather dispatcher: each rank its experts
    if dispatcher != "allgather":  # NOTE: "any", "alltoall", "hierarchical"
        out.append(Strategy((S0, S0, S0, S0, S0), (S0,), exchange=_exchanged(op, 2)))  # all-to-all
    return out


@RULES.rule(EXPERTS_BACKWARD)
def moe_experts_backward(op: Op) -> list[Strategy]:
    """(grad, hidden, index, weights, w_gate_up, w_down) -> (d_hidden, d_weights, d_gate_up, d_down)."""
    capacity, dispatcher = _options(op, 6)
    out = [
        Strategy((R, R, R, R, R, R), (R, R, R, R)),
        Strategy((P, R, R, R, R, R), (P, P, P, P)),  # linear in the incoming gradient
    ]
    out.append(Strategy((R, R, R, R, S2, S2), (P, P, S2, S2)))
    if capacity == 0:
        out.append(Strategy((S0, S0, S0, S0, R, R), (S0, S0, P, P)))
    if dispatcher in ("any", "allgather"):
        out.append(Strategy((R, R, R, R, S0, S0), (P, P, S0, S0)))
    if dispatcher != "allgather":
        out.append(Strategy((S0, S0, S0, S0, S0, S0), (S0, S0, S0, S0), exchange=_exchanged(op, 3)))
    return out
