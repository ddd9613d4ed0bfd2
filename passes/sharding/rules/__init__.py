"""Sharding rules, one module per op family; ``rule_table()`` merges their ``RULES``."""

from __future__ import annotations

from ir import Op, TensorType
from passes.sharding.rules import matmul
from passes.sharding.rules.registry import RuleSet, RuleTable, rule_table
from passes.sharding.strategy import Strategy, replicate_only

# NOTE: every family module is listed here once; rule_table() reads this tuple.
FAMILIES: tuple[RuleSet, ...] = (matmul.RULES,)


def strategies_for(op: Op, table: RuleTable) -> tuple[list[Strategy], str]:
    """The op's single-axis strategies and where they came from: ``rule`` or ``replicate``."""
    fn = table.get(op.target)
    if fn is not None:
        return fn(op), "rule"
    n_in = sum(1 for v in op.operands if isinstance(v.type, TensorType) or True)
    return replicate_only(n_in, len(op.results)), "replicate"


__all__ = ["FAMILIES", "RuleSet", "RuleTable", "rule_table", "strategies_for"]
