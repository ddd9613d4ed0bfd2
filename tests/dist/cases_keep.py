"""Tasks for tests/dist/test_keep.py: what a user does with a compiled module besides plain steps
(dtype mistakes, model bugs, odd sizes, gradient accumulation, clipping, bf16), each compared with the
single-device model; and determinism of the compiled graph across processes."""

from __future__ import annotations

import hashlib
import os
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfold.api import parallelize
from meshfold.passes.options import Options
from meshfold.session import compile_model
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build
from tests.dist.cases import ATOL, EPS, LR, PARAM_ATOL, RTOL


def _pair(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """Two copies of ``make()`` with the same weights: one to compile, one to run on this rank alone."""
    torch.manual_seed(0)
    net = make()
    ref = make()
    ref.load_state_dict(net.state_dict())
    return net, ref


def _same_grads(pm: nn.Module, ref: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    want = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        assert p.grad is not None and want[name].grad is not None, name
        got = p.grad.full_tensor()
        assert got.dtype == want[name].grad.dtype, (name, got.dtype)
        torch.testing.assert_close(got, want[name].grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"grad {n}: {m}")


def _same_params(pm: nn.Module, ref: nn.Module, atol: float = PARAM_ATOL) -> None:
    want = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(
            p.detach().full_tensor(), want[name].detach(), rtol=0, atol=atol, msg=lambda m, n=name: f"param {n}: {m}"
        )


def _meet() -> None:
    """Every rank reaches one all_reduce: nothing was left half-issued."""
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size(), "ranks fell out of step"


def bf16_input_to_fp32_model() -> dict[str, str]:
    """A bf16 input to an fp32 model raises, as it does on one device, on every rank alike; the module
    then still trains equal to the single-device model on fp32 inputs."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    net, (x, y) = build("mlp")
    ref, _ = build("mlp")
    pm = parallelize(net, mesh, (x, y), plan="fsdp+tp")
    try:
        ref(x.bfloat16(), y)
    except RuntimeError as e:
        single = str(e)
    else:
        raise AssertionError("the single-device model took a bf16 input")
    try:
        pm(x.bfloat16(), y)
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("the compiled model took a bf16 input")
    _meet()
    pm(x, y).backward()
    ref(x, y).backward()
    _same_grads(pm, ref)
    return {"said": said, "single": single}


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(3))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.bias  # mismatched: [8, 4] + [3]


class _BadBroadcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.lin(x)).sum()


def broadcasting_bug() -> dict[str, str]:
    """A shape bug in the user's forward fails ``parallelize`` on every rank as the shape error it is
    (the single-device model fails on the same line); the ranks stay in step."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((4,), ("dp",))
    net, ref = _pair(_BadBroadcast)
    x = torch.randn(8, 4)
    try:
        ref(x)
    except RuntimeError as e:
        single = str(e)
    else:
        raise AssertionError("the single-device model ran")
    try:
        parallelize(net, mesh, (x,), plan="ddp")
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("parallelize accepted a model that cannot run")
    _meet()
    return {"said": said, "single": single}


class _Odd(nn.Module):
    """A column/row pair around a hidden size of ``hidden``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, hidden)
        self.fc2 = nn.Linear(hidden, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(nn.functional.gelu(self.fc1(x))), y)


def indivisible_hidden(hidden: int = 30, steps: int = 2) -> dict[str, Any]:
    """``plan="tp"`` on tp=4 with a hidden size 4 does not divide: a warning names each parameter it
    cannot split, and training equals the single-device model. Returns the warnings this rank saw and
    the parameters' layouts."""
    mesh = device_mesh((4,), ("tp",))
    net, ref = _pair(lambda: _Odd(hidden))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pm = parallelize(net, mesh, (x, y), plan="tp")
    said = [str(w.message) for w in seen if issubclass(w.category, UserWarning) and "does not divide" in str(w.message)]
    _train_side_by_side(pm, ref, [(x, y)] * steps)
    return {"warnings": said, "layouts": {i.name: str(i.value.layout) for i in pm.graph().inputs if i.kind == "param"}}


def _train_side_by_side(pm: nn.Module, ref: nn.Module, batches: list[tuple[Any, ...]]) -> None:
    """One AdamW step per batch on both; loss, every gradient and the parameters after must agree."""
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    for batch in batches:
        opt.zero_grad()
        ref_opt.zero_grad()
        loss, ref_loss = pm(*batch), ref(*batch)
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
        _same_grads(pm, ref)
        opt.step()
        ref_opt.step()
    _same_params(pm, ref)


def _llama_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` different llama-tiny batches of the example inputs' shape (so no call recompiles)."""
    _, (ids, _) = build("llama-tiny")
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        t = torch.randint(0, 256, tuple(ids.shape), generator=gen)
        out.append((t, t.clone()))
    return out


def _llama_fsdp_tp() -> tuple[Any, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """llama-tiny compiled with fsdp+tp on (dp=2, tp=2) beside its single-device twin, each with AdamW."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    net, inputs = build("llama-tiny")
    ref, _ = build("llama-tiny")
    pm = parallelize(net, mesh, inputs, plan="fsdp+tp")
    return (
        pm,
        ref,
        torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS),
        torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS),
    )


def gradient_accumulation(micro: int = 3, steps: int = 2) -> float:
    """``micro`` backward calls summed into ``.grad`` before each AdamW step (the loss scaled by
    1/micro), under fsdp+tp: accumulated gradients and the parameters after equal single device."""
    pm, ref, opt, ref_opt = _llama_fsdp_tp()
    batches = _llama_batches(micro * steps)
    total = 0.0
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        for ids, labels in batches[step * micro : (step + 1) * micro]:
            loss, ref_loss = pm(ids, labels) / micro, ref(ids, labels) / micro
            loss.backward()
            ref_loss.backward()
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
            total += float(loss)
        # NOTE: each backward adds its own rounding to .grad, so the bound grows with the micro-batches
        _same_grads(pm, ref, atol=micro * ATOL)
        opt.step()
        ref_opt.step()
    _same_params(pm, ref)
    return total


def clip_grad_norm(max_norm: float = 0.05, steps: int = 2) -> list[float]:
    """``torch.nn.utils.clip_grad_norm_`` over the compiled module's parameters (DTensors sharded
    differently under fsdp+tp) returns the single-device total norm and clips alike. Returns the norms."""
    pm, ref, opt, ref_opt = _llama_fsdp_tp()
    norms = []
    for ids, labels in _llama_batches(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        pm(ids, labels).backward()
        ref(ids, labels).backward()
        norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        norm = norm.full_tensor() if isinstance(norm, torch.distributed.tensor.DTensor) else norm
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL)
        assert float(ref_norm) > max_norm, "the gradients are too small for clipping to matter"
        _same_grads(pm, ref)
        opt.step()
        ref_opt.step()
        norms.append(float(norm))
    _same_params(pm, ref)
    return norms


def bf16_model(steps: int = 2) -> dict[str, Any]:
    """llama-tiny in bf16 under fsdp+tp: parameters, gradients and outputs stay bf16 and agree with the
    single-device bf16 model to bf16 precision (sharding changes the order of sums). Returns the
    largest differences."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    net, inputs = build("llama-tiny")
    ref, _ = build("llama-tiny")
    net, ref = net.to(torch.bfloat16), ref.to(torch.bfloat16)
    pm = parallelize(net, mesh, inputs, plan="fsdp+tp")
    assert all(p.dtype == torch.bfloat16 for p in pm.parameters())
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    worst = {"loss": 0.0, "grad": 0.0}
    want = dict(ref.named_parameters())
    for ids, labels in _llama_batches(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss, ref_loss = pm(ids, labels), ref(ids, labels)
        loss.backward()
        ref_loss.backward()
        assert loss.dtype == ref_loss.dtype, (loss.dtype, ref_loss.dtype)
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=2e-2, atol=1e-2)
        worst["loss"] = max(worst["loss"], abs(float(loss) - float(ref_loss)))
        for name, p in pm.named_parameters():
            got, exp = p.grad.full_tensor(), want[name].grad
            assert got.dtype == torch.bfloat16, (name, got.dtype)
            # NOTE: bf16 keeps 8 bits of mantissa; a gradient summed in another order differs by a few
            # ulps of its largest entries, so the bound scales with the gradient's own size.
            scale = float(exp.abs().max())
            torch.testing.assert_close(
                got.float(), exp.float(), rtol=0, atol=0.05 * scale + 1e-6, msg=lambda m, n=name: f"grad {n}: {m}"
            )
            worst["grad"] = max(worst["grad"], float((got.float() - exp.float()).abs().max()) / (scale or 1.0))
        opt.step()
        ref_opt.step()
    return worst


def graph_digest(model: str, mesh: str, plan: str) -> tuple[str, int]:
    """SHA-256 of the graph text ``compile_model`` gives for ``model`` on ``mesh`` with ``plan`` in this
    process (the mesh need not be the pool's: nothing runs), and this process's hash of a fixed string
    (processes differ in it unless PYTHONHASHSEED is fixed). The test compares digests across ranks and
    with its own process."""
    warnings.filterwarnings("ignore")
    net, inputs = build(model)
    text = str(compile_model(net, inputs, Options.of(mesh=mesh, plan=plan)).graph)
    return hashlib.sha256(text.encode()).hexdigest(), hash("meshfold")


def killed_rank(where: str, victim: int = 3, steps: int = 50) -> None:
    """``victim`` is killed (SIGKILL) between two training steps of llama-tiny under fsdp+tp; every
    other rank must raise from its next step. Each survivor writes ``where/rank<r>`` (seconds since the
    victim stamped ``where/died`` just before dying, then the error) and ends its process, as an
    uncaught exception ends a rank under torchrun: that is what lets ranks waiting on a survivor (not on
    the victim itself) see the failure too."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    net, inputs = build("llama-tiny")
    pm = parallelize(net, mesh, inputs, plan="fsdp+tp")
    pm(*inputs).backward()
    _meet()
    stamp, rank = Path(where) / "died", dist.get_rank()
    if rank == victim:
        stamp.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(steps):
            pm(*inputs).backward()
    except Exception as e:
        now = time.time()
        (Path(where) / f"rank{rank}").write_text(f"{now - float(stamp.read_text()):.3f} {type(e).__name__}: {e}")
        os._exit(17)
    raise AssertionError(f"{steps} steps ran with rank {victim} dead")
