"""Tasks for tests/dist/test_constants.py: a model whose forward makes tensor constants (a Python
list as an index, scalars assigned into slices) trains like the single-device model."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from meshfold.api import parallelize
from meshfold.tools.pool_worker import device_mesh
from tests.dist.cases_programs import _same_step


class _Gather(nn.Module):
    """Column- and row-parallel linears around list indexing and slice assignments."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        h = h.clone()
        h[:, 0] = 0.5
        h[:, 1:4] = -2
        out = self.down(h)
        picked = out[..., [3, 0, 7]]
        return nn.functional.mse_loss(picked, y[..., :3]) + out.mean()


def constants(steps: int = 2) -> list[float]:
    """Losses of ``steps`` steps on (dp=2, tp=2); every step's loss and gradients equal single device."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    net, ref = _Gather(), _Gather()
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pm = parallelize(net, mesh, (x, y), plan="ddp+tp")
    assert "meshfold.constant" in str(pm.graph())
    losses = []
    for _ in range(steps):
        _same_step(pm, ref, x, y)
        losses.append(float(ref(x, y)))
    return losses
