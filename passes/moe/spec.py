"""The expert mapping a user asks for with ``moe=`` (``MoeSpec``), and the layouts it gives the
expert weights of a captured graph.

``MoeSpec`` is ``parallelize(..., moe={"ep": 4, "etp": 1})``: the experts' own factorization of the
same ranks (ETP innermost, then EP, then EDP, as Megatron-Core orders them), mapped onto whole mesh
axes. ``plan_with_experts`` turns it into plan entries for every expert weight found in the graph
(``experts_sites``); the sharding pass reads them from the context's plan and spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshfold import ir
from meshfold.ir.dialects.moe import EXPERTS
from meshfold.passes.base import PassError
from meshfold.passes.sharding.plans import AUTO, Plan


@dataclass(frozen=True)
class ExpertsSite:
    """One experts module captured as ``meshfold.moe_experts``."""

    path: str
    gate_up: str
    """FQN of the ``[E, 2I, H]`` gate/up weight."""
    down: str
    """FQN of the ``[E, H, I]`` down weight."""
    act: str
    num_experts: int
    intermediate: int
    gate_up_rank: int = 3
    """3 for ``[E, 2I, H]``; 4 for ``[E, 2, I, H]`` (experts folded from an nn.ModuleList), which ETP
    can split on I without separating an expert's gate rows from its up rows."""


DISPATCHERS = ("allgather", "alltoall")
DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class MoeSpec:
    """The expert mapping: ``ep`` ranks split the experts, ``etp`` split each expert; the remaining
    factor of the world (EDP) holds replicas whose gradients are reduced among themselves."""

    ep: int = 1
    etp: int = 1
    dispatcher: str = "alltoall"
    capacity_factor: float | None = None
    """None: dropless; else each expert takes at most ``ceil(tokens * k / E * factor)`` pairs."""
    drop_policy: str = "probs"
    """Which pairs an expert over capacity keeps: highest routing weight, or earliest position."""
    hierarchical: bool = False
    pad_to_capacity: bool = False
    """With a capacity: the all-to-all moves ``capacity`` rows per expert (static splits)."""

    @property
    def policy(self) -> str:
        """The experts op's drop-policy argument."""
        return self.drop_policy + ("+pad" if self.pad_to_capacity else "")

    @staticmethod
    def of(spec: Mapping[str, Any]) -> MoeSpec:
        known = set(MoeSpec.__dataclass_fields__)
        unknown = sorted(set(spec) - known)
        if unknown:
            raise PassError(f"moe={dict(spec)!r}: unknown keys {unknown}; known: {sorted(known)}")
        out = MoeSpec(**dict(spec))
        if out.dispatcher not in DISPATCHERS:
            raise PassError(f"moe dispatcher {out.dispatcher!r}: use one of {', '.join(DISPATCHERS)}")
        if out.drop_policy not in DROP_POLICIES:
            raise PassError(f"moe drop_policy {out.drop_policy!r}: use one of {', '.join(DROP_POLICIES)}")
        if out.pad_to_capacity and (out.capacity_factor is None or out.hierarchical):
            raise PassError(
                "moe pad_to_capacity needs a capacity_factor and the one-hop all-to-all (hierarchical=False)"
            )
        if out.capacity_factor is not None and out.capacity_factor <= 0:
            raise PassError(f"moe capacity_factor={out.capacity_factor}: use a positive factor, or None for dropless")
        if out.ep < 1 or out.etp < 1:
            raise PassError(f"moe={dict(spec)!r}: ep and etp must be positive")
        return out

    def axes(self, mesh: ir.Mesh) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(etp, ep, edp) mesh axes: ETP takes the innermost axes, EP the next, EDP the rest, each a
        product of whole axes (Megatron-Core's tp-cp-ep-dp order on the expert side)."""
        names = list(reversed(mesh.names))
        picked: list[tuple[str, ...]] = []
        for what, size in (("etp", self.etp), ("ep", self.ep)):
            taken: list[str] = []
            prod = 1
            while prod < size and names:
                taken.append(names.pop(0))
                prod *= mesh.size(taken[-1])
            if prod != size:
                raise PassError(
                    f"moe {what}={size} on mesh {mesh}: experts map {what} onto whole mesh axes, innermost first "
                    f"(after etp), and no such run of axes has {size} ranks"
                )
            picked.append(tuple(reversed(taken)))
        return picked[0], picked[1], tuple(reversed(names))


def expert_overrides(spec: MoeSpec, sites: list[ExpertsSite], mesh: ir.Mesh) -> dict[str, dict[str, str]]:
    """Plan entries placing every expert weight: its expert dim split over the EP axes, whole on the
    EDP axes. Raises,
    naming the rule, for mappings Megatron-Core's constraints (or this version) rule out."""
    if not sites:
        raise PassError(
            "moe= was given but the model has no MoE layer meshfold can fold (see the warnings naming its MoE "
            "layers, or write the experts with meshfold.moe_experts)"
        )
    if spec.hierarchical and spec.dispatcher != "alltoall":
        raise PassError("moe hierarchical=True is a form of the all-to-all dispatcher; use dispatcher='alltoall'")
    etp_axes, ep_axes, edp_axes = spec.axes(mesh)
    out: dict[str, dict[str, str]] = {}
    for site in sites:
        if site.num_experts % spec.ep:
            raise PassError(f"moe ep={spec.ep}: {site.path} has {site.num_experts} experts; num_experts % ep must be 0")
        if site.intermediate % spec.etp:
            raise PassError(
                f"moe etp={spec.etp}: {site.path} has intermediate size {site.intermediate}; "
                "intermediate % etp must be 0"
            )
        # NOTE: replicas over EDP, whatever the plan does there: their gradients are reduced over
        # the EDP axes only, and the experts are never gathered across EP. Over ETP the down weight
        # is split on I; a gate/up weight [E, 2I, H] is kept whole there and each rank computes
        # with its [E, 2, I/etp, H] slice (its gate and up rows are not one contiguous block), one
        # stored as [E, 2, I, H] is split on I too.
        base = {axis: "S(0)" for axis in ep_axes} | {axis: "R" for axis in edp_axes}
        split_i = "S(2)" if site.gate_up_rank == 4 else "R"
        out[site.gate_up] = base | {axis: split_i for axis in etp_axes}
        out[site.down] = base | {axis: "S(2)" for axis in etp_axes}
    return out


def experts_sites(graph: ir.Graph) -> list[ExpertsSite]:
    """One site per forward ``meshfold.moe_experts`` op whose expert weights are parameters of the graph
    (directly or through views, such as the ``[E, 2I, H] -> [E, 2, I, H]`` view of the gate/up weight).

    NOTE: read off the captured graph rather than the model, so IR files and models that call
    ``meshfold.moe_experts`` themselves get their experts mapped too.
    """
    params = {i.value: i.name for i in graph.inputs if i.kind == "param"}
    producers = graph.producers()
    sites: list[ExpertsSite] = []
    for op in graph.ops:
        if op.target != EXPERTS:
            continue
        gate_up, down = (_viewed_param(op.operands[k], params, producers) for k in (3, 4))
        if gate_up is None or down is None or not isinstance(down.type, ir.TensorType) or down.type.rank != 3:
            continue
        num, inter = down.type.shape[0], down.type.shape[2]
        act = op.args[5] if len(op.args) > 5 else op.kwarg("act", "silu")
        if isinstance(num, int) and isinstance(inter, int) and isinstance(gate_up.type, ir.TensorType):
            where = {"path": op.prov.module, "gate_up": params[gate_up], "down": params[down]}
            sites.append(
                ExpertsSite(**where, act=str(act), num_experts=num, intermediate=inter, gate_up_rank=gate_up.type.rank)
            )
    return sites


def _viewed_param(value: ir.Value, params: dict[ir.Value, str], producers: dict[ir.Value, ir.Op]) -> ir.Value | None:
    """The parameter ``value`` is, or is a chain of reshaping views of (``ir.view_trait``); None for
    anything else."""
    while value not in params:
        op = producers.get(value)
        trait = None if op is None else ir.view_trait(op.target)
        if op is None or trait is None or not trait.reshape or not op.operands:
            return None
        value = op.operands[0]
    return value


def plan_with_experts(plan: Plan, spec: MoeSpec, graph: ir.Graph, mesh: ir.Mesh) -> Plan:
    """``plan`` plus the expert weights' layouts for ``spec``: they win over the plan's own entries
    and are pinned (every use reads them as planned: the experts are never gathered)."""
    check_spec(plan, spec, mesh)
    entries = expert_overrides(spec, experts_sites(graph), mesh)
    kept = tuple((glob, axes) for glob, axes in plan.overrides if glob not in entries)
    return Plan(plan.preset, kept + Plan.of(plan.preset, entries).overrides, tuple(entries))


def check_spec(plan: Plan, spec: MoeSpec, mesh: ir.Mesh) -> None:
    """What can be refused before capture: ``moe=`` with ``plan='auto'``, and a mapping the mesh's
    axes cannot carry."""
    if plan.preset == AUTO:
        raise PassError("plan='auto' chooses the expert mapping itself; drop moe= or name a preset plan")
    spec.axes(mesh)
