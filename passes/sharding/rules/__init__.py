"""Sharding rules, one module per op family; ``rule_table()`` merges their ``RULES``.

:func:`strategies_for` is the one entry point passes use: our rule if there is one, else DTensor's
registries through :mod:`passes.sharding.rules.fallback`, else Replicate only (the caller warns).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from meshfold.ir import Op, Partial, Placement, R, Shard, Target, TensorType, target_name
from meshfold.passes.sharding.rules import (
    attention,
    causal_conv,
    creation,
    embedding,
    indexing,
    linear_recurrence,
    matmul,
    norm,
    pointwise,
    reduction,
    routed_experts,
    shape,
)
from meshfold.passes.sharding.rules.fallback import dtensor_ops, fallback_strategies
from meshfold.passes.sharding.rules.operands import is_float
from meshfold.passes.sharding.rules.table import RuleFn, RuleSet, RuleTable
from meshfold.passes.sharding.strategy import Strategy, replicate_only

# NOTE: every family module is listed here once; rule_table() reads this tuple.
FAMILIES: tuple[RuleSet, ...] = (
    matmul.RULES,
    pointwise.RULES,
    reduction.RULES,
    shape.RULES,
    norm.RULES,
    attention.RULES,
    embedding.RULES,
    indexing.RULES,
    creation.RULES,
    routed_experts.RULES,
    linear_recurrence.RULES,
    causal_conv.RULES,
)


def rule_table() -> RuleTable:
    """Build the table from every family module (a fresh dict each call)."""
    rules: dict[Target, RuleFn] = {}
    family: dict[Target, str] = {}
    for rs in FAMILIES:
        for t, fn in rs.rules.items():
            if t in rules:
                raise ValueError(f"{target_name(t)} has rules in both {family[t]} and {rs.family}")
            rules[t] = fn
            family[t] = rs.family
    return RuleTable(rules, family)


Source = Literal["rule", "dtensor", "replicate"]


class RuleError(ValueError):
    """A rule returned a malformed strategy (wrong arity, a dim out of range, a non-tensor sharded)."""


def strategies_for(op: Op, table: RuleTable) -> tuple[list[Strategy], Source]:
    """Single-axis strategies of ``op`` and where they came from.

    ``"rule"``: ours; ``"dtensor"``: DTensor's registries; ``"replicate"``: neither knows the op, so
    only the all-Replicate strategy (the caller warns). Every list starts with the all-Replicate
    strategy and never shards a size-1 dim or puts a Partial on a non-floating tensor.
    """
    n_in, n_out = len(op.operands), len(op.results)
    fn = table.get(op.target)
    if fn is not None:
        return _clean(op, fn(op), strict=True), "rule"
    found = fallback_strategies(op)
    if found:
        return _clean(op, found, strict=False), "dtensor"
    return replicate_only(n_in, n_out), "replicate"


def _clean(op: Op, strategies: list[Strategy], *, strict: bool) -> list[Strategy]:
    """Check arity and dims (a rule's mistake raises when ``strict``, else the strategy is dropped),
    drop shards of size-1 dims and Partials on non-float tensors, and put all-Replicate first."""
    values = (*op.operands, *op.results)
    everything_r = replicate_only(len(op.operands), len(op.results))[0]
    out = [everything_r]
    for raw in strategies:
        s = _widen(op, raw)
        problem = _malformed(op, s)
        if problem is not None:
            if strict:
                raise RuleError(f"{op.describe()}: the rule's strategy {s} is malformed: {problem}")
            continue
        if all(_allowed(v.type, p) for v, p in zip(values, (*s.inputs, *s.outputs), strict=True)):
            out.append(s)
    return list(dict.fromkeys(out))


def _widen(op: Op, s: Strategy) -> Strategy:
    """NOTE: a rule may spell only the tensor operands; scalar operands (``sym_size`` results used
    as sizes) are then Replicate at their positions."""
    tensors = [i for i, v in enumerate(op.operands) if isinstance(v.type, TensorType)]
    if len(s.inputs) != len(tensors) or len(tensors) == len(op.operands):
        return s
    inputs: list[Placement] = [R for _ in op.operands]
    for i, p in zip(tensors, s.inputs, strict=True):
        inputs[i] = p
    return replace(s, inputs=tuple(inputs))


def _malformed(op: Op, s: Strategy) -> str | None:
    if len(s.inputs) != len(op.operands) or len(s.outputs) != len(op.results):
        return f"expected {len(op.operands)} inputs and {len(op.results)} outputs"
    for v, p in zip((*op.operands, *op.results), (*s.inputs, *s.outputs), strict=True):
        t = v.type
        if not isinstance(t, TensorType):
            if p != R:
                return f"%{v.name} is not a tensor but is {p}"
        elif isinstance(p, Shard) and not 0 <= p.dim < t.rank:
            return f"%{v.name} has rank {t.rank} but is {p}"
    return None


def _allowed(t: object, p: object) -> bool:
    if not isinstance(t, TensorType):
        return True
    if isinstance(p, Shard):
        return t.shape[p.dim] != 1
    if isinstance(p, Partial):
        return is_float(t)
    return True


def rule_coverage() -> tuple[int, int]:
    """Over DTensor's known ops plus ours: how many get our rule, how many only DTensor's."""
    ours = set(rule_table().rules)
    return len(ours), len(dtensor_ops() - ours)


__all__ = [
    "FAMILIES",
    "RuleError",
    "RuleSet",
    "RuleTable",
    "Source",
    "rule_coverage",
    "rule_table",
    "strategies_for",
]
