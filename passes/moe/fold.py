"""``moe-fold``: apply the expert mapping (``PassContext.moe``) to every experts op of the graph.

Capture folds each MoE layer meshfold recognizes into one ``meshfold.moe_experts`` op (and its
backward); this pass gives every such op the mapping's dispatcher, capacity and drop policy, and
checks the mapping against the graph's experts (``num_experts % ep``, ``intermediate % etp``, EP/ETP
on whole mesh axes) so a bad one fails here, naming the rule. The expert weights' layouts follow
from the spec (``plan_with_experts``), which the sharding pass applies. Without a spec it returns
the graph unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from meshfold import ir
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD, capacity_of
from meshfold.passes.base import JOINT, Pass
from meshfold.passes.moe.spec import MoeSpec, check_spec, expert_overrides, experts_sites
from meshfold.passes.sharding.plans import effective_plan

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

EXPERTS_MAPPED = "experts-mapped"


@dataclass(frozen=True)
class MoeFold(Pass):
    """Give every experts op the context's expert mapping (dispatcher, capacity, drop policy)."""

    name: ClassVar[str] = "moe-fold"
    requires: ClassVar[frozenset[str]] = frozenset({JOINT})
    ensures: ClassVar[frozenset[str]] = frozenset({EXPERTS_MAPPED})
    invalidates: ClassVar[frozenset[str]] = frozenset()

    def apply(self, ctx: PassContext, graph: ir.Graph) -> ir.Graph:
        spec = ctx.options.moe
        if spec is None:
            return graph
        if ctx.mesh is not None:
            check_spec(effective_plan(ctx.options.plan, ctx.mesh), spec, ctx.mesh)
            expert_overrides(spec, experts_sites(graph), ctx.mesh)  # NOTE: raises, naming the rule
        return with_spec(graph, spec)


def with_spec(graph: ir.Graph, spec: MoeSpec) -> ir.Graph:
    """``graph`` with every experts op (found or marked) taking ``spec``'s capacity, drop policy and
    dispatcher; the capacity is computed from each op's own token count, top-k and expert count."""
    dispatcher = "hierarchical" if spec.hierarchical else spec.dispatcher
    ops = []
    for op in graph.ops:
        at = 0 if op.target == EXPERTS else 1 if op.target == EXPERTS_BACKWARD else None
        if at is None:
            ops.append(op)
            continue
        hidden, idx, down = (op.operands[at + k].type for k in (0, 1, 4))
        assert isinstance(hidden, ir.TensorType) and isinstance(idx, ir.TensorType) and isinstance(down, ir.TensorType)
        cap = capacity_of(int(hidden.shape[0]), int(idx.shape[1]), int(down.shape[0]), spec.capacity_factor or 0.0)
        ops.append(dataclasses.replace(op, args=(*op.args[: at + 6], cap, spec.policy, dispatcher)))
    return dataclasses.replace(graph, ops=tuple(ops))
