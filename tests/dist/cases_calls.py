"""Tasks for tests/dist/test_calls.py: a call no program can run raises on every rank alike, before
any collective of a program, and the module stays usable."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from meshfold.api import parallelize
from meshfold.runtime.signature import CallMismatch
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build
from tests.dist.cases import ATOL, RTOL


def _refused(call: Any) -> str:
    try:
        call()
    except CallMismatch as e:
        return str(e)
    raise AssertionError("the call was not refused")


def mismatched_calls() -> dict[str, str]:
    """Compile llama-tiny and mlp on (dp=2, tp=2), then make each kind of call no program can run;
    returns the message every rank raised for each, and checks that a batch dp does not divide and a
    normal call afterwards equal single device."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    model, (ids, labels) = build("llama-tiny")
    ref, _ = build("llama-tiny")
    pm = parallelize(model, mesh, (ids, labels), plan="fsdp+tp")
    # NOTE: a batch dp does not divide runs whole on each dp rank, equal to one device
    torch.testing.assert_close(
        pm(ids[:1], labels[:1]).detach(), ref(ids[:1], labels[:1]).detach(), rtol=RTOL, atol=ATOL
    )
    said: dict[str, str] = {}
    # NOTE: only the last rank gets a different batch; the others must not be left waiting
    last = dist.get_rank() == dist.get_world_size() - 1
    said["one rank"] = _refused(lambda: pm(ids[:1] if last else ids, labels[:1] if last else labels))
    torch.testing.assert_close(pm(ids, labels).detach(), ref(ids, labels).detach(), rtol=RTOL, atol=ATOL)
    mlp, (x, y) = build("mlp")
    pm_mlp = parallelize(mlp, mesh, (x, y), plan="fsdp+tp")
    said["bf16"] = _refused(lambda: pm_mlp(x.bfloat16(), y))
    said["input grad"] = _refused(lambda: pm_mlp(x.clone().requires_grad_(), y))
    with torch.no_grad():  # NOTE: no gradient is asked for: the call runs
        torch.testing.assert_close(pm_mlp(x.clone().requires_grad_(), y), mlp(x, y), rtol=RTOL, atol=ATOL)

    @parallelize(mesh=mesh, plan="fsdp+tp", example_inputs=(x, y))
    class Net(type(mlp)):  # type: ignore[misc]
        pass

    torch.manual_seed(0)  # NOTE: every rank builds the same weights, as a training script does
    net = Net()
    net.eval()
    single = net._mf_model[0].eval()  # NOTE: the single-device model Net() built
    torch.testing.assert_close(net(x, y).detach(), single(x, y).detach(), rtol=RTOL, atol=ATOL)
    said["decorated programs"] = str(net._mf_compiled[0].programs())
    return said
