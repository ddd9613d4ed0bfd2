"""The rule table: op target → rule function. Each family module declares a ``RuleSet`` and
decorates its rules; ``rule_table()`` merges the family sets (a target claimed twice is an error)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshfold.ir import Op, Target, target_name
from meshfold.passes.sharding.strategy import Strategy

RuleFn = Callable[[Op], list[Strategy]]
"""Given an op (with global operand and result types), its single-axis strategies."""


LocalizeFn = Callable[[Op, tuple[tuple[int, ...], ...]], tuple[tuple[Any, ...], dict[str, Any]]]
"""Given an op and its results' LOCAL shapes, the args and kwargs to call it with on one rank."""


@dataclass(frozen=True)
class Ranged:
    """An op whose local form depends on which slice ``[lo, lo + size)`` of an indexed dim this rank
    holds (vocab-parallel embedding, gather/scatter along a sharded dim): out-of-range indices are
    masked. ``where(op)`` names the indexed tensor — ``("operand", i, dim)`` or ``("result", i, dim)``;
    ``impl(lo, size, *args, **kwargs)`` computes the op on one rank's shard (a module-level function,
    so lowered fx graphs can call it)."""

    where: Callable[[Op], tuple[str, int, int]]
    impl: Callable[..., Any]


@dataclass
class RuleSet:
    """The rules of one op family, registered with :meth:`rule`."""

    family: str
    rules: dict[Target, RuleFn] = field(default_factory=dict)
    localizers: dict[Target, LocalizeFn] = field(default_factory=dict)
    ranged: dict[Target, Ranged] = field(default_factory=dict)

    def rule(self, *targets: Target, shape_arg: int | None = None) -> Callable[[RuleFn], RuleFn]:
        """``@RULES.rule(aten.mm.default)`` registers a rule for those targets.

        ``shape_arg``: index of a positional argument that spells the first result's shape
        (``view``'s size, ``full``'s size); on a rank it becomes the local shape.
        """

        def deco(fn: RuleFn) -> RuleFn:
            for t in targets:
                if t in self.rules:
                    raise ValueError(f"{self.family}: two rules for {target_name(t)}")
                self.rules[t] = fn
                if shape_arg is not None:
                    self.localizers[t] = _shape_arg_localizer(shape_arg)
            return fn

        return deco

    def ranged_impl(self, target: Target, where: Callable[[Op], tuple[str, int, int]]) -> Callable[[Any], Any]:
        """Register the local form of ``target`` when its indexed dim (``where``) is sharded."""

        def deco(fn: Any) -> Any:
            self.ranged[target] = Ranged(where, fn)
            return fn

        return deco

    def localizer(self, *targets: Target) -> Callable[[LocalizeFn], LocalizeFn]:
        """Register how to rewrite an op's non-tensor arguments for local shapes."""

        def deco(fn: LocalizeFn) -> LocalizeFn:
            for t in targets:
                self.localizers[t] = fn
            return fn

        return deco


def _shape_arg_localizer(index: int) -> LocalizeFn:
    def localize(op: Op, local_shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Argument ``index`` becomes the first result's local shape; everything else is unchanged."""
        args = list(op.args)
        args[index] = tuple(local_shapes[0])
        return tuple(args), dict(op.kwargs)

    return localize


@dataclass(frozen=True)
class RuleTable:
    """All of our rules by target, which family each came from, and argument localizers."""

    rules: dict[Target, RuleFn]
    family: dict[Target, str]
    localizers: dict[Target, LocalizeFn]
    ranged: dict[Target, Ranged] = field(default_factory=dict)

    def get(self, target: Target) -> RuleFn | None:
        return self.rules.get(target)


def rule_table() -> RuleTable:
    """Build the table from every family module (a fresh dict each call)."""
    from meshfold.passes.sharding.rules import FAMILIES

    rules: dict[Target, RuleFn] = {}
    family: dict[Target, str] = {}
    localizers: dict[Target, LocalizeFn] = {}
    ranged: dict[Target, Ranged] = {}
    for rs in FAMILIES:
        ranged.update(rs.ranged)
        for t, fn in rs.rules.items():
            if t in rules:
                raise ValueError(f"{target_name(t)} has rules in both {family[t]} and {rs.family}")
            rules[t] = fn
            family[t] = rs.family
        localizers.update(rs.localizers)
    return RuleTable(rules, family, localizers, ranged)
