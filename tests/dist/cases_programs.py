"""Tasks for tests/dist/test_programs.py: new shapes, modes and no-grad calls get programs of their
own, equal to the single-device model; random ops agree across ranks whatever each rank's seed."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfold.api import parallelize
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build
from tests.dist.cases import ATOL, RTOL
from tests.dist.cases_calls import _refused


def _same_step(pm: nn.Module, ref: nn.Module, *inputs: torch.Tensor) -> None:
    """One forward and backward on both; the losses and every gradient must agree."""
    for p in [*pm.parameters(), *ref.parameters()]:
        p.grad = None
    got, want = pm(*inputs), ref(*inputs)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=RTOL, atol=ATOL)
    got.backward()
    want.backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name].grad, rtol=RTOL, atol=ATOL)


def new_shapes(backend: str = "eager") -> dict[str, Any]:
    """mlp and llama-tiny on (dp=2, tp=2): other batch sizes and sequence lengths compile programs of
    their own that equal single device, a batch dp does not divide too (computed whole on each dp rank)."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    mlp, (x, y) = build("mlp")
    ref, _ = build("mlp")
    pm = parallelize(mlp, mesh, (x, y), plan="fsdp+tp", cache_size=3, backend=backend)
    _same_step(pm, ref, x[:4], y[:4])  # the last, smaller batch
    _same_step(pm, ref, x, y)
    _same_step(pm, ref, x[:3], y[:3])  # NOTE: dp does not divide it: each dp rank computes all 3 rows
    said: dict[str, Any] = {}
    last = dist.get_rank() == dist.get_world_size() - 1
    said["one rank"] = _refused(lambda: pm(x[:2] if last else x, y[:2] if last else y))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _same_step(pm, ref, x[:2], y[:2])  # a fourth signature: the least recently used goes
    said["evicted"] = [str(w.message) for w in caught if "cache_size" in str(w.message)]
    said["programs"] = pm.programs()
    llama, (ids, labels) = build("llama-tiny")
    ref_llama, _ = build("llama-tiny")
    pm_llama = parallelize(llama, mesh, (ids, labels), plan="fsdp+tp", backend=backend)
    _same_step(pm_llama, ref_llama, torch.cat([ids, ids], 1), torch.cat([labels, labels], 1))
    _same_step(pm_llama, ref_llama, ids[:, :8], labels[:, :8])
    _same_step(pm_llama, ref_llama, ids, labels)
    said["llama programs"] = len(pm_llama.programs())
    # NOTE: the second length compiled one symbolic program; the third was made from it
    templates = pm_llama._mf_programs.templates
    said["llama templates"] = [
        (t.specialized, sorted({str(d) for i in t.graph.inputs if i.kind == "input" for d in i.value.type.shape}))
        for t in templates
    ]
    said["mlp templates"] = len(pm._mf_programs.templates)
    said["llama compiled"] = pm_llama._mf_programs.compiled
    return said


class _Net(nn.Module):
    """Linear, BatchNorm, dropout on a tp-split activation, a row-parallel linear, dropout on a
    replicated activation, and an MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(32, 16)
        self.out_drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.norm(self.up(x))))
        return nn.functional.mse_loss(self.out_drop(self.down(h)), y)


def _net_pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net = _Net()
    ref = _Net()
    ref.load_state_dict(net.state_dict())
    return net, ref


def modes_and_seeds(steps: int = 3, backend: str = "eager") -> dict[str, Any]:
    """Every rank seeds alike, compiles, then reseeds with its own rank (as data loaders do): the
    compiled module's dropout masks stay the single-device model's, step after step. Then eval mode
    (dropout off, running statistics used and kept) and no-grad calls equal single device."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    net, ref = _net_pair()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    pm = parallelize(net, mesh, (x, y), plan="ddp+tp", backend=backend)
    torch.manual_seed(dist.get_rank())  # NOTE: each rank's own seed must not matter
    ref_state = torch.get_rng_state()
    said: dict[str, Any] = {"losses": []}
    for _ in range(steps):
        torch.set_rng_state(state)
        want = ref(x, y)
        state = torch.get_rng_state()
        torch.set_rng_state(ref_state)
        got = pm(x, y)
        torch.testing.assert_close(got.detach(), want.detach(), rtol=RTOL, atol=ATOL)
        for p in [*pm.parameters(), *ref.parameters()]:
            p.grad = None
        got.backward()
        want.backward()
        for (name, p), q in zip(pm.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=RTOL, atol=ATOL, msg=name)
        said["losses"].append(float(got))
    for name, b in pm.named_buffers():
        torch.testing.assert_close(b.full_tensor(), dict(ref.named_buffers())[name], rtol=RTOL, atol=ATOL)
    pm.eval()
    ref.eval()
    _same_step(pm, ref, x, y)
    torch.testing.assert_close(pm(x, y).detach(), pm(x, y).detach())  # no dropout, no statistics update
    with torch.no_grad():
        got = pm(x, y)
        assert not got.requires_grad
        torch.testing.assert_close(got, ref(x, y), rtol=RTOL, atol=ATOL)
        pm.train()
        ref.train()
        torch.set_rng_state(state)
        torch.testing.assert_close(pm(x, y), ref(x, y), rtol=RTOL, atol=ATOL)
    for name, b in pm.named_buffers():
        torch.testing.assert_close(b.full_tensor(), dict(ref.named_buffers())[name], rtol=RTOL, atol=ATOL)
    pm.manual_seed(5)
    torch.manual_seed(5)
    torch.testing.assert_close(pm(x, y).detach(), ref(x, y).detach(), rtol=RTOL, atol=ATOL)
    held = pm._mf_programs._held.values()
    said["backward collectives without grad"] = sorted(
        sum(1 for op in p.graph.ops if op.prov.phase == "bwd") for p in held if not p.signature.grad
    )
    said["programs"] = pm.programs()
    return said


class _Mlp(nn.Module):
    """Two linears and a GELU with an MSE loss: under autocast the linears run in bf16, the loss in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.down(nn.functional.gelu(self.up(x))), y)


def autocast_calls() -> dict[str, Any]:
    """A module compiled outside autocast, called under ``torch.autocast("cpu", bfloat16)``: a
    program of its own for that state, equal to the single-device model under the same autocast;
    called outside it again, the first program, equal to the fp32 model.

    Bounds: with the batch split (fsdp on dp), every row's forward is the single-device row's, so the
    loss agrees to fp32 rounding. A weight gradient is a sum over the batch: each rank's bf16 matmul
    rounds its part once (half an ulp: bf16 keeps 8 significant bits, 2^-8 relative) where one device
    rounds the whole sum once, so the two differ by at most 2^-8 (sum of |parts| + |sum|); with the
    parts' magnitudes below the largest gradient element, 2^-8 * (4 + 1) of the largest element."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((4,), ("dp",))
    torch.manual_seed(0)
    net, ref = _Mlp(), _Mlp()
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pm = parallelize(net, mesh, (x, y))  # NOTE: the mesh's default plan: fsdp on dp
    said: dict[str, Any] = {}

    def step(cast: bool) -> tuple[float, float]:
        for p in [*pm.parameters(), *ref.parameters()]:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
            got, want = pm(x, y), ref(x, y)
        torch.testing.assert_close(got.detach(), want.detach(), rtol=RTOL, atol=ATOL)
        got.backward()
        want.backward()
        bound = 5 * 2.0**-8 if cast else ATOL
        for (name, p), q in zip(pm.named_parameters(), ref.parameters(), strict=True):
            assert q.grad is not None
            worst = float((p.grad.full_tensor() - q.grad).abs().max())
            assert worst <= bound * float(q.grad.abs().max()) + ATOL, (name, worst, float(q.grad.abs().max()))
        return float(got), float(want)

    plain = step(False)
    cast = step(True)
    said["autocast changes the loss"] = abs(cast[0] - plain[0]) > 1e-6
    said["again without autocast"] = step(False) == plain
    said["programs"] = [text for text, _ in pm.programs()]
    return said
