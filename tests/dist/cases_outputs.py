"""Tasks for tests/dist/test_outputs.py: what the compiled module returns and where it leaves gradients,
compared with the single-device model."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from meshfold.api import parallelize
from meshfold.tools.pool_worker import device_mesh
from tests.dist.cases import ATOL, EPS, LR, PARAM_ATOL, RTOL


class TwoHeads(nn.Module):
    """A trunk with two heads, each giving its own loss; ``frozen`` feeds the loss only through
    ``detach`` and ``side`` only a returned tensor that is not a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)
        self.side = nn.Linear(16, 4)
        self.frozen = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x)) + self.frozen.detach()
        return self.a(h).pow(2).mean(), self.b(h).pow(2).mean(), self.side(h)


class Labelled(nn.Module):
    """Returns a dict or a tuple holding a string and an int next to tensors."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor) -> Any:
        y = self.lin(x)
        loss = y.pow(2).mean()
        if self.as_dict:
            return {"loss": loss, "name": "x", "logits": y, "n": 3}
        return loss, "x", y, 3


def _models(make: Any) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net = make()
    ref = make()
    ref.load_state_dict(net.state_dict())
    return net, ref


def grads_where_reached(plan: str, which: int, steps: int = 2) -> dict[str, Any]:
    """Call ``backward`` on output ``which`` of :class:`TwoHeads`, compiled and single-device, then AdamW.
    ``.grad`` must be None exactly where it is None on one device, every other gradient and every
    parameter after the step equal. Returns the parameter names left without a gradient."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((4,), ("dp",))
    net, ref = _models(TwoHeads)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    pm = parallelize(net, mesh, (x,), plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    ref_params = dict(ref.named_parameters())
    no_grad: list[str] = []
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        pm(x)[which].sum().backward()
        ref(x)[which].sum().backward()
        for name, p in pm.named_parameters():
            want = ref_params[name].grad
            got = p.grad
            if want is None:
                assert got is None, f"{name}: single-device grad is None, compiled has {got}"
                no_grad.append(name)
                continue
            assert got is not None, f"{name}: compiled grad is None"
            torch.testing.assert_close(got.full_tensor(), want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        opt.step()
        ref_opt.step()
    for name, p in pm.named_parameters():
        got = p.full_tensor().detach()
        torch.testing.assert_close(got, ref_params[name].detach(), rtol=0, atol=PARAM_ATOL, msg=name)
    return {"no_grad": sorted(set(no_grad))}


def non_tensor_outputs(plan: str, as_dict: bool) -> dict[str, Any]:
    """Compile :class:`Labelled`; its output must have the model's structure, the same non-tensor values
    and tensors equal to the single-device model's, and training through it must match."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((4,), ("dp",))
    net, ref = _models(lambda: Labelled(as_dict))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    pm = parallelize(net, mesh, (x,), plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        got, want = pm(x), ref(x)
        assert type(got) is type(want), (type(got), type(want))
        got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
        want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
        assert got_spec == want_spec, (got_spec, want_spec)
        for g, w in zip(got_leaves, want_leaves, strict=True):
            if isinstance(w, torch.Tensor):
                assert isinstance(g, torch.Tensor), g
                torch.testing.assert_close(g.detach(), w.detach(), rtol=RTOL, atol=ATOL)
            else:
                assert type(g) is type(w) and g == w, (g, w)
        (got["loss"] if as_dict else got[0]).backward()
        (want["loss"] if as_dict else want[0]).backward()
        opt.step()
        ref_opt.step()
    ref_params = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.full_tensor().detach(), ref_params[name].detach(), rtol=0, atol=PARAM_ATOL)
    return {"keys": sorted(got) if as_dict else len(got)}
