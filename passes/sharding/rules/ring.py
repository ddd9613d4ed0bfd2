"""Ring attention's steps (``meshfold.ring_step``, its backward and ``meshfold.lse_merge``; see
``ir.ring``), which ``passes/cp/steps.py`` writes after the solve in place of a sequence-split
attention: every operand and result holds one layout on each axis, batch, heads or sequence split
alike (the step's own ranks pass the keys by ``comm.ppermute``, not by a layout change).
"""

from __future__ import annotations

from meshfold.ir import Op, R, Shard
from meshfold.ir.ring import LSE_MERGE, RING_STEP, RING_STEP_BACKWARD
from meshfold.passes.sharding.rules.registry import RuleSet
from meshfold.passes.sharding.strategy import Strategy

RULES = RuleSet("ring")


@RULES.rule(RING_STEP, RING_STEP_BACKWARD, LSE_MERGE)
def ring_step(op: Op) -> list[Strategy]:
    """Every tensor ``[batch, heads, seq, ...]`` held alike: whole, or split along dim 0, 1 or 2."""
    ins, outs = len(op.operands), len(op.results)
    return [Strategy((p,) * ins, (p,) * outs) for p in (R, Shard(0), Shard(1), Shard(2))]
