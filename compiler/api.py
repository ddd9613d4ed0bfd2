"""``parallelize``: the front door. Capture, choose layouts, insert collectives, lower, run."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
from rich.console import Console
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshfold import ir
from meshfold.backends.eager import RankContext, exchange_axes, lower
from meshfold.moe import MoeSpec, check_spec, plan_with_experts, with_spec
from meshfold.passes import PassContext, PassError, PassPipeline, parse_size
from meshfold.passes.cost.hardware import Cluster, parse_cluster
from meshfold.passes.sharding.plans import Plan, axis_roles, default_preset
from meshfold.pipeline import DEFAULT_PIPELINE
from meshfold.runtime import ParallelModule
from meshfold.tracer import capture

PlanSpec = str | Plan | Mapping[str, Any]


def ir_mesh(mesh: DeviceMesh) -> ir.Mesh:
    """The IR's description of a ``DeviceMesh`` (which must have named dims)."""
    names = mesh.mesh_dim_names
    if not names:
        raise PassError(
            "the DeviceMesh has no dim names; create it with "
            "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))"
        )
    return ir.Mesh(tuple(names), tuple(int(s) for s in mesh.mesh.shape))


def to_plan(plan: PlanSpec, mesh: ir.Mesh) -> Plan:
    """A preset string, a ``Plan``, or a user dict ``{fqn_glob: {axis: "S(d)"|"R"|"P"}}`` with an
    optional ``"preset"`` key (default: from the mesh's axis names, see ``default_preset``)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str):
        return Plan.of(plan)
    entries = dict(plan)
    preset = entries.pop("preset", None)
    if preset is None:
        preset = default_preset(mesh)
    for glob, axes in entries.items():
        if not isinstance(axes, Mapping):
            raise PassError(f"plan entry {glob!r} must map mesh axes to placements, e.g. {{'tp': 'S(0)'}}")
    return Plan.of(str(preset), entries)


def parallelize(
    model: nn.Module | None = None,
    mesh: DeviceMesh | None = None,
    example_inputs: Sequence[Any] | None = None,
    plan: PlanSpec = "ddp",
    *,
    verify: bool = False,
    pipeline: str = DEFAULT_PIPELINE,
    cluster: str | Cluster | None = None,
    memory: int | str | None = None,
    moe: Mapping[str, Any] | None = None,
) -> Any:
    """Compile ``model`` for ``mesh`` with ``plan`` and return this rank's ``ParallelModule``.

    Everything that can be wrong with the request (mesh vs world size, unknown preset or axis,
    indivisible sizes, a batch the data-parallel ranks do not divide) raises before any collective.
    ``verify``: the first step also checks every value on every rank against the single-device
    model and raises ``VerificationError`` naming the first that differs (op, module path, layouts).

    Without a model, ``@parallelize(mesh=..., plan=...)`` decorates an ``nn.Module`` subclass:
    constructing it builds the model, its first call compiles it for those inputs (create the
    optimizer after that call: the parameters are the compiled module's DTensors).

    ``plan="auto"``: the sharding solve chooses every parameter's and input's layout as well, for
    the hardware ``cluster`` (``"h100:8x1"``; default: gloo ranks on this CPU) under a per-device
    ``memory`` bound (bytes or ``"40GiB"``; default: the cluster's device memory).

    ``moe={"ep": 4, "etp": 1}``: the routed experts of every MoE layer meshfold recognizes (see
    ``meshfold.moe``) get their own mapping of the same ranks: EP ranks split the experts (innermost
    mesh axes after ETP), the rest of the world (EDP) replicates them, whatever ``plan`` does with
    attention. Invalid mappings raise before anything runs, naming the rule.
    """
    target = Target(
        parse_cluster(cluster) if isinstance(cluster, str) else cluster,
        parse_size(memory) if isinstance(memory, str) else memory,
        MoeSpec.of(moe) if moe is not None else None,
    )
    if model is None:
        if mesh is None:
            raise PassError("parallelize needs a mesh: @parallelize(mesh=init_device_mesh(...), plan='fsdp+tp')")
        return _decorator(mesh, plan, verify, pipeline, target)
    if mesh is None or example_inputs is None:
        raise PassError("parallelize(model, mesh, example_inputs, plan=...) needs the mesh and example inputs")
    return _compile(model, mesh, example_inputs, plan, verify, pipeline, target)


@dataclass(frozen=True)
class Target:
    """The hardware a plan is made for and the per-device memory bound (None: defaults)."""

    cluster: Cluster | None = None
    memory: int | None = None
    moe: MoeSpec | None = None


def _compile(
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[Any],
    plan: PlanSpec,
    verify: bool,
    pipeline: str,
    target: Target = Target(),
) -> ParallelModule:
    if not dist.is_initialized():
        raise PassError("parallelize needs torch.distributed initialized (run under torchrun or spawn ranks)")
    world = dist.get_world_size()
    if mesh.size() != world:
        raise PassError(
            f"the mesh has {mesh.size()} ranks {tuple(mesh.mesh.shape)} but the world has {world}; "
            f"build the mesh over all {world} ranks"
        )
    imesh = ir_mesh(mesh)
    the_plan = to_plan(plan, imesh)
    if target.moe is not None:
        check_spec(the_plan, target.moe, imesh)
    axis_roles(the_plan, imesh)  # NOTE: a bad preset or axis fails here, before the capture
    ctx = PassContext(mesh=imesh, plan=the_plan, cluster=target.cluster, memory=target.memory)
    compiled = _compile_once(model, example_inputs, pipeline, ctx, target.moe)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the mesh"
    groups = tuple(mesh.get_group(i).group_name for i in range(mesh.ndim))
    # NOTE: every rank compiled the same graph, so all create the same groups in the same order
    flat = tuple((axes, mesh[axes]._flatten().get_group().group_name) for axes in exchange_axes(compiled))
    rank = RankContext(imesh, tuple(coordinate), groups, flat)
    lowered = lower(compiled, rank)
    checked = (lower(compiled, rank, record=True), rank) if verify else None
    n_out = sum(1 for o in compiled.outputs if o.kind == "out")
    return ParallelModule(model, mesh, compiled, lowered, output_is_tuple=n_out > 1, verify_with=checked)


def _compile_once(
    model: nn.Module, example_inputs: Sequence[Any], pipeline: str, ctx: PassContext, moe: MoeSpec | None = None
) -> ir.Graph:
    """Capture and run the pipeline on rank 0 only; every rank gets the graph as IR text.

    NOTE: one plan for all ranks by construction (the sharding solve may stop at a time limit,
    where results depend on machine speed), and the other ranks do not repeat the work. A failure
    on rank 0 is sent as its message and raised on every rank."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            if sys.stderr.isatty():
                ctx.status = Console(stderr=True).status
            graph = capture(model, example_inputs, moe=moe)
            if moe is not None:
                # NOTE: the experts are found in the captured graph (modules meshfold recognizes, and
                # code calling meshfold.moe_experts alike)
                assert ctx.mesh is not None and isinstance(ctx.plan, Plan)
                graph = with_spec(graph, moe)
                ctx.plan = plan_with_experts(ctx.plan, moe, graph, ctx.mesh)
            compiled, _ = PassPipeline.parse(pipeline).run(ctx, graph)
            payload[0] = ("ok", str(compiled))
        except Exception as e:
            payload[0] = ("error", f"{type(e).__name__}: {e}")
            dist.broadcast_object_list(payload, src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    kind, text = payload[0]
    if kind != "ok":
        raise PassError(f"compilation failed on rank 0: {text}")
    return ir.parse(text)


M = TypeVar("M", bound=nn.Module)


def _decorator(
    mesh: DeviceMesh, plan: PlanSpec, verify: bool, pipeline: str, target: Target
) -> Callable[[type[M]], type[M]]:
    def deco(cls: type[M]) -> type[M]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise PassError(f"@parallelize(...) decorates nn.Module subclasses, not {cls!r}")

        def make(*args: Any, **kwargs: Any) -> LazyParallel:
            return LazyParallel(cls(*args, **kwargs), mesh, plan, verify, pipeline, target)

        functools.update_wrapper(make, cls, updated=())
        return make  # type: ignore[return-value]

    return deco


class LazyParallel(nn.Module):
    """A decorated model: compiled on its first call, then that call's ``ParallelModule`` runs it.

    After compilation the compiled module's parameters appear here under the model's own FQNs.
    """

    def __init__(
        self, model: nn.Module, mesh: DeviceMesh, plan: PlanSpec, verify: bool, pipeline: str, target: Target
    ) -> None:
        super().__init__()
        self._mf_model = [model]  # NOTE: a list, so the uncompiled model is not a submodule
        self._mf_args = (mesh, plan, verify, pipeline, target)
        self._mf_compiled: list[ParallelModule] = []

    def forward(self, *inputs: Any) -> Any:
        if not self._mf_compiled:
            mesh, plan, verify, pipeline, target = self._mf_args
            pm = _compile(self._mf_model[0], mesh, inputs, plan, verify, pipeline, target)
            self._mf_compiled.append(pm)
            for name, child in pm._modules.items():
                self.add_module(name, child)
            for name, p in pm._parameters.items():
                self.register_parameter(name, p)
        return self._mf_compiled[0](*inputs)
