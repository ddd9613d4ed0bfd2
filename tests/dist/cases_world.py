"""Tasks for tests/dist/test_world.py: what a world given without axis names does on every rank."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from meshfold.api import parallelize
from meshfold.passes import PassError
from meshfold.tools.zoo import build


def refused(plan: str | None, unnamed_mesh: bool) -> dict[str, Any]:
    """``parallelize`` on the world with ``plan``: what it raised, on this rank."""
    model, inputs = build("mlp")
    world = torch.distributed.get_world_size()
    mesh: Any = init_device_mesh("cpu", (world,)) if unnamed_mesh else world
    try:
        parallelize(model, mesh, inputs, plan=plan)
    except PassError as e:
        return {"said": str(e)}
    return {"said": ""}


def wrong_world() -> dict[str, Any]:
    """``parallelize`` told the world has one rank more than it has."""
    model, inputs = build("mlp")
    try:
        parallelize(model, torch.distributed.get_world_size() + 1, inputs, plan="auto")
    except PassError as e:
        return {"said": str(e)}
    return {"said": ""}


def decorated() -> dict[str, Any]:
    """``@parallelize(mesh=world, plan="auto", ...)`` on a class: an instance trains one step as the
    single-device model does; returns its mesh and the largest gradient difference."""
    from meshfold.tools.zoo.models import MLP

    world = torch.distributed.get_world_size()
    _, inputs = build("mlp")
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(0)
    net = parallelize(mesh=world, plan="auto", example_inputs=inputs)(MLP)()
    net(*inputs).backward()
    ref(*inputs).backward()
    worst = 0.0
    for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters(), strict=True):
        assert q.grad is not None and p.grad is not None, name
        worst = max(worst, float((p.grad.full_tensor() - q.grad).abs().max()))
    mesh = net._mf_compiled[0].mesh
    return {"mesh": (tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape)), "worst": worst}
