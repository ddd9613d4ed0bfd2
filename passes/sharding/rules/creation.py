"""Ops that create tensors: factories (``arange``, ``full``, ``zeros``, ``scalar_tensor``, ...), the
``*_like`` family (and the samplers that fill a tensor of their input's shape) and the ``new_*`` family.

Factories have no tensor operands and produce Replicate only (a sharded ``arange`` would need its
bounds rewritten per rank). ``*_like`` results have their input's shape and no dependence on its
values, so they follow a sharded input and are Replicate for a Replicate or Partial one. ``new_*``
results take their shape from the ``size`` argument alone: whatever the input's placement, the
result may be Replicate or sharded on any dim (``size`` is rewritten to the local shape).
"""

from __future__ import annotations

import torch

from meshfold.ir import Partial, Placement, R, Shard
from meshfold.ir.dialects.constant import CONSTANT
from meshfold.ir.graph import Op
from meshfold.passes.sharding.rules.operands import einsum_of, letters, result_type, tensor_type_of
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies

aten = torch.ops.aten
RULES = RuleSet("creation")


@RULES.rule(aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format, CONSTANT)
def sized_factory(op: Op) -> list[Strategy]:
    """`` -> _ _``: a factory from a size (or a literal, ``meshfold.constant``); Replicate only."""
    return [Strategy(tuple(R for _ in op.operands), tuple(R for _ in op.results))]


@RULES.rule(
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.scalar_tensor.default,
    aten.eye.default,
    aten.eye.m,
    aten.linspace.default,
    aten.empty_strided.default,
)
def factory(op: Op) -> list[Strategy]:
    """`` -> _``: values depend on global positions (or strides are global); Replicate only."""
    return [Strategy(tuple(R for _ in op.operands), tuple(R for _ in op.results))]


@RULES.rule(
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.exponential.default,
    aten.uniform.default,
    aten.normal_functional.default,
)
def like(op: Op) -> list[Strategy]:
    """``a b -> a b`` (shards follow the input); a Partial input gives a Replicate result, since
    only the input's (global) shape matters. The functional samplers (``exponential_``, ``uniform_``,
    ``normal_`` on a fresh tensor) overwrite every value of theirs alike; each rank draws the whole
    tensor and keeps its shard (``backends.random``)."""
    t = tensor_type_of(op.operands[0])
    assert t is not None
    g = letters(t.rank)
    base = einsum_strategies(einsum_of([g], [g]))
    partial_in: list[Strategy] = [Strategy((Partial(k),), (R,)) for k in ("sum", "avg", "max")]
    return [*base, *partial_in]


@RULES.rule(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default)
def new_sized(op: Op) -> list[Strategy]:
    """``x, -> r`` with ``size`` given: the input only lends dtype and device, so any input placement
    pairs with a Replicate result or one sharded on any dim (``size`` becomes the local shape)."""
    t = tensor_type_of(op.operands[0])
    assert t is not None
    ins: list[Placement] = [R, *(Shard(d) for d in range(t.rank)), Partial("sum"), Partial("avg"), Partial("max")]
    outs: list[Placement] = [R, *(Shard(d) for d in range(result_type(op).rank))]
    return [Strategy((i,), (o,)) for i in ins for o in outs]


@RULES.rule(aten.new_empty_strided.default)
def new_strided(op: Op) -> list[Strategy]:
    """``x, -> _``: sizes and strides are global; any input placement gives a Replicate result."""
    t = tensor_type_of(op.operands[0])
    assert t is not None
    ins: list[Placement] = [R, *(Shard(d) for d in range(t.rank)), Partial("sum"), Partial("avg"), Partial("max")]
    return [Strategy((i,), (R,)) for i in ins]
