"""Bad requests to ``parallelize``: each must raise a clear error before any collective runs."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshfold.api import parallelize
from meshfold.passes import PassError
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build


class Odd(nn.Module):
    """A layer whose output dim (5) no mesh axis of size 2 divides."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).pow(2).mean()


def _error(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except PassError as e:
        return str(e)
    raise AssertionError("no error raised")


def bad_requests() -> dict[str, str]:
    """Run every bad request on this rank; then all ranks must still meet in one all_reduce."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2,), ("dp",))
    mesh_pp = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("pp",), _init_backend=False)
    model, inputs = build("mlp")
    out = {
        "axis": _error(lambda: parallelize(model, mesh, inputs, plan={"fc1.weight": {"pp": "S(0)"}})),
        "preset": _error(lambda: parallelize(model, mesh, inputs, plan="zero3")),
        "axis-role": _error(lambda: parallelize(model, mesh, inputs, plan="tp")),
        "glob": _error(lambda: parallelize(model, mesh, inputs, plan={"nothing.*": {"dp": "R"}})),
        "indivisible": _error(
            lambda: parallelize(Odd(), mesh, (torch.randn(4, 6),), plan={"preset": "ddp", "lin.weight": {"dp": "S(0)"}})
        ),
        # NOTE: a pipeline's microbatches must split the batch evenly (their losses are averaged)
        "microbatches": _error(
            lambda: parallelize(model, mesh_pp, (torch.randn(3, 32), torch.randn(3, 16)), plan="pp", pp={})
        ),
        "placement": _error(lambda: parallelize(model, mesh, inputs, plan={"fc1.weight": {"dp": "S(x)"}})),
    }
    small = DeviceMesh("cpu", torch.arange(1), mesh_dim_names=("dp",), _init_backend=False)
    out["world"] = _error(lambda: parallelize(model, small, inputs, plan="ddp"))
    unnamed = DeviceMesh("cpu", torch.arange(2), _init_backend=False)
    out["names"] = _error(lambda: parallelize(model, unnamed, inputs, plan="ddp"))
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size(), "ranks fell out of step after the errors"
    return out
