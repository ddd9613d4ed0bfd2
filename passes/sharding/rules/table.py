"""The rule table: op target → rule function. Each family module declares a ``RuleSet`` and
decorates its rules; ``rule_table()`` merges the family sets (a target claimed twice is an error)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from meshfold.ir import Op, Target, target_name
from meshfold.passes.sharding.strategy import Strategy

RuleFn = Callable[[Op], list[Strategy]]
"""Given an op (with global operand and result types), its single-axis strategies."""


@dataclass
class RuleSet:
    """The rules of one op family, registered with :meth:`rule`."""

    family: str
    rules: dict[Target, RuleFn] = field(default_factory=dict)

    def rule(self, *targets: Target) -> Callable[[RuleFn], RuleFn]:
        """``@RULES.rule(aten.mm.default)`` registers a rule for those targets."""

        def deco(fn: RuleFn) -> RuleFn:
            for t in targets:
                if t in self.rules:
                    raise ValueError(f"{self.family}: two rules for {target_name(t)}")
                self.rules[t] = fn
            return fn

        return deco


@dataclass(frozen=True)
class RuleTable:
    """All of our rules by target and which family each came from."""

    rules: dict[Target, RuleFn]
    family: dict[Target, str]

    def get(self, target: Target) -> RuleFn | None:
        return self.rules.get(target)
