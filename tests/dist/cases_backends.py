"""Tasks for the backends' rank tests: what ``backend="inductor"`` refuses before anything runs, and
where the collectives of its compiled code overlap the matrix products."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from meshfold.api import parallelize
from meshfold.passes import PassError
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build

T = TypeVar("T")


def inductor_refused(kind: str) -> str:
    """Compile, under ``backend="inductor"``, llama-tiny with every activation offloaded
    (``"offload"``: host copies Inductor cannot compile); return the error."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    assert kind == "offload", kind
    net, inputs = build("llama-tiny")
    options = {"plan": "fsdp+tp", "memory": "offload"}
    try:
        parallelize(net, mesh, inputs, backend="inductor", **options)
    except PassError as e:
        return str(e)
    raise AssertionError(f"backend='inductor' compiled the {kind} model it cannot run")


_MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


def _eager_windows(module: torch.fx.GraphModule) -> list[int]:
    """Per wait of an eager module: the matrix products between its collective's start and it."""
    nodes = list(module.graph.nodes)
    before, seen = {}, 0
    for node in nodes:
        before[node] = seen
        seen += str(node.target) in _MATMULS
    out = []
    for node in nodes:
        if "wait_tensor" in str(node.target):
            start = node.args[0]
            while "c10d" not in str(start.target) and "by_all_to_all" not in str(start.target):
                start = start.args[0]  # NOTE: through the views a started collective's result takes
            out.append(before[node] - before[start])
    return out


def _compiled_windows(code: str) -> list[int]:
    """The same for the Python wrapper Inductor generated: its extern matrix products between a
    collective's call and the wait on its buffer."""
    started: dict[str, int] = {}
    seen, out = 0, []
    for line in (raw.split("#")[0] for raw in code.splitlines()):
        issue = re.search(r"(\w+) = torch\.ops\._c10d_functional\.\w+\.default\(", line) or re.search(
            r"_c10d_functional\.all_reduce_\.default\((\w+)", line
        )
        if issue and "wait_tensor" not in line:
            started[issue.group(1)] = seen
        wait = re.search(r"_c10d_functional\.wait_tensor\.default\((\w+)", line)
        if wait and wait.group(1) in started:
            out.append(seen - started.pop(wait.group(1)))
        seen += bool(re.search(r"extern_kernels\.(mm|addmm|bmm)\(", line))
    return out


def first_step_windows(pm: Any, step: Callable[[], T]) -> tuple[T, dict[str, list[list[int]]]]:
    """``step()``, the first call of ``pm``'s programs compiled by Inductor, and per collective the
    matrix products that run while it is in flight, in the eager modules (the order the overlap pass
    chose) and in the code Inductor generated from them, forward then backward."""
    from torch._inductor.utils import run_and_get_code

    low = pm._mf_programs.first.lowered
    result, codes = run_and_get_code(step)
    return result, {
        "eager": [_eager_windows(low.forward.module), _eager_windows(low.backward.module)],
        "inductor": [_compiled_windows(c) for c in codes],
    }


def one_rank_on(device: str, backend: str, process_group: str, port: int) -> float:
    """In this process, as a world of one rank on ``device`` (``"cuda"``, ``"npu"``; the group's
    backend ``process_group``): train llama-tiny one step under ``backend`` beside the single-device
    model on CPU; return the largest gradient difference (the loss must agree first)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group(process_group, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,), mesh_dim_names=("dp",))
    net, inputs = build("llama-tiny")
    ref, _ = build("llama-tiny")
    on_device = tuple(x.to(device) for x in inputs)
    pm = parallelize(net.to(device), mesh, on_device, backend=backend)
    loss = pm(*on_device)
    loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach(), rtol=1e-4, atol=1e-4)
    want = dict(ref.named_parameters())
    worst = 0.0
    for name, p in pm.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, float((grad.cpu() - want[name].grad).abs().max()))
    return worst
