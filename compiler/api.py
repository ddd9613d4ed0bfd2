"""``parallelize``: the front door. Capture, choose layouts, insert collectives, lower, run."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import ir
from backends.eager import RankContext, lower
from compiler.capture import capture
from compiler.pipeline import DEFAULT_PIPELINE
from compiler.runtime import ParallelModule
from passes import PassContext, PassError, PassPipeline
from passes.sharding.plans import Plan, axis_roles, default_preset

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
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[Any],
    plan: PlanSpec = "ddp",
    *,
    pipeline: str = DEFAULT_PIPELINE,
) -> ParallelModule:
    """Compile ``model`` for ``mesh`` with ``plan`` and return this rank's ``ParallelModule``.

    Everything that can be wrong with the request (mesh vs world size, unknown preset or axis,
    indivisible sizes, a batch the data-parallel ranks do not divide) raises before any collective.
    """
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
    axis_roles(the_plan, imesh)  # NOTE: a bad preset or axis fails here, before the capture
    ctx = PassContext(mesh=imesh, plan=the_plan)
    graph = capture(model, example_inputs)
    compiled, _ = PassPipeline.parse(pipeline).run(ctx, graph)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the mesh"
    groups = tuple(mesh.get_group(i).group_name for i in range(mesh.ndim))
    lowered = lower(compiled, RankContext(imesh, tuple(coordinate), groups))
    n_out = sum(1 for o in compiled.outputs if o.kind == "out")
    return ParallelModule(model, mesh, compiled, lowered, output_is_tuple=n_out > 1)


M = TypeVar("M", bound=nn.Module)


def parallelize_class(mesh: DeviceMesh, plan: PlanSpec = "ddp") -> Callable[[type[M]], Callable[..., Any]]:
    """``@parallelize_class(mesh=..., plan=...)`` on an ``nn.Module`` subclass: construction builds the
    model; the first call compiles it with those inputs, later calls run the compiled module."""

    def deco(cls: type[M]) -> Callable[..., Any]:
        @functools.wraps(cls, updated=())
        def make(*args: Any, **kwargs: Any) -> _Lazy:
            return _Lazy(cls(*args, **kwargs), mesh, plan)

        return make

    return deco


class _Lazy(nn.Module):
    def __init__(self, model: nn.Module, mesh: DeviceMesh, plan: PlanSpec) -> None:
        super().__init__()
        self._mf_model = [model]
        self._mf_mesh = mesh
        self._mf_plan = plan
        self._mf_compiled: ParallelModule | None = None

    def forward(self, *inputs: Any) -> Any:
        if self._mf_compiled is None:
            self._mf_compiled = parallelize(self._mf_model[0], self._mf_mesh, inputs, self._mf_plan)
            self.add_module("compiled", self._mf_compiled)
        return self._mf_compiled(*inputs)


_ = torch
