"""Causal convolutions along the sequence (``meshfold.causal_conv1d`` and its backward; see
``ir.dialects.conv``).

``causal_conv1d(x [B, C, L], w [C, 1, K], bias [C]) -> [B, C, L]``: batch and channels ride along
(a channel's filter and bias with it); the sequence splits too, each rank taking the last ``K - 1``
positions of the rank before it (``backends/context_parallel/halo.py``: ``B x C x (K - 1)`` numbers, the strategy's
exchange). The backward ``(grad, x, w) -> (dx, dw, dbias)``: ``dw`` and ``dbias`` sum over batch
and sequence (``P(sum)`` when those split); linear in ``grad``.
"""

from __future__ import annotations

from meshfold.ir import Op, Partial, R, Shard, TensorType
from meshfold.ir.dialects.conv import CONV, CONV_BACKWARD
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy

RULES = RuleSet("conv")
P = Partial("sum")
S0, S1, S2 = Shard(0), Shard(1), Shard(2)


def _halo(op: Op, at: int) -> float:
    """Bytes of the ``K - 1`` positions each rank passes on (the operand ``x`` at ``at``)."""
    x, w = op.operands[at].type, op.operands[at + 1].type
    assert isinstance(x, TensorType) and isinstance(w, TensorType), f"{op.describe()}: x and w must be tensors"
    return float(int(x.shape[0]) * int(x.shape[1]) * (int(w.shape[-1]) - 1) * x.dtype.itemsize)


@RULES.rule(CONV)
def causal_conv1d(op: Op) -> list[Strategy]:
    """(x, w, bias) -> y: ``b c l, c _ _, c -> b c l``, the sequence split with a halo."""
    return [
        Strategy((R, R, R), (R,)),
        Strategy((S0, R, R), (S0,)),
        Strategy((S1, S0, S0), (S1,)),
        Strategy((S2, R, R), (S2,), exchange=_halo(op, 0)),
    ]


@RULES.rule(CONV_BACKWARD)
def causal_conv1d_backward(op: Op) -> list[Strategy]:
    """(grad, x, w) -> (dx, dw, dbias)."""
    return [
        Strategy((R, R, R), (R, R, R)),
        Strategy((P, R, R), (P, P, P)),
        Strategy((S0, S0, R), (S0, P, P)),
        Strategy((S1, S1, S0), (S1, S0, S0)),
        Strategy((S2, S2, R), (S2, P, P), exchange=2 * _halo(op, 1)),
    ]
