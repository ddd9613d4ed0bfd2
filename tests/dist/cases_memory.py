"""Tasks that measure a compiled model's peak tensor memory on each rank and set it beside the
liveness estimate of ``passes.cost.memory`` for the same compiled graph."""

from __future__ import annotations

import contextlib
import ctypes
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from meshfold.api import parallelize
from meshfold.tools.zoo.models import LlamaTiny
from meshfold.passes.cost.memory import rank_memory
from tests.dist.pool import device_mesh


def _walk(nodes: list[Any]) -> Iterator[Any]:
    for n in nodes:
        yield n
        yield from _walk(n.children)


@contextlib.contextmanager
def allocator_accounting() -> Iterator[None]:
    """Have the CPU allocator keep its live-byte count for frees on every thread.

    Without this, only threads that carry the profiler's state report to it: a block whose last
    reference a gloo worker thread drops (its ``Work`` object holds the collective's input and
    output) is freed unseen, and the profile shows it live to the end of the step; how often that
    happens depends on thread timing. c10's ``caffe2_report_cpu_memory_usage`` flag makes the
    allocator count every allocation and free, whichever thread makes it, and each profiler event
    then carries that global count as ``total_allocated``."""
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    before = flag.value
    flag.value = True
    try:
        yield
    finally:
        flag.value = before


def peak_new_bytes(fn: Callable[[], object]) -> int:
    """Peak of the bytes the CPU allocator had handed out while ``fn`` ran, above what was live when it
    began: the allocator's own live count at each allocation event, so frees on every thread count.
    (A block allocated before ``fn`` and freed by another thread during it is counted only if it was
    allocated under ``allocator_accounting`` too.)"""
    with allocator_accounting(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (n.start_time_ns, n.extra_fields.alloc_size, n.extra_fields.total_allocated)
        for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
        if n.tag == _EventType.Allocation and str(n.extra_fields.device) == "cpu"
    )
    if not events:
        return 0
    _, size, total = events[0]
    start = total - size  # the live count just before the first event
    return max(0, int(max(total for _, _, total in events)) - int(start))


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct local storages behind ``tensors`` (DTensors count their shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        s = local.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def step_memory(
    shape: tuple[int, ...], names: tuple[str, ...], plan: str, hidden: int, batch: int, seq: int
) -> dict[str, Any]:
    """Compile a Llama-style model, take one AdamW step (so the optimizer state exists), then measure
    the next step's forward + backward: resident bytes (parameters, buffers, optimizer state) plus
    the allocator's peak on top of them. Returns measured and estimated figures on this rank."""
    with allocator_accounting():
        return _step_memory(shape, names, plan, hidden, batch, seq)


def _step_memory(
    shape: tuple[int, ...], names: tuple[str, ...], plan: str, hidden: int, batch: int, seq: int
) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    mesh = device_mesh(tuple(shape), tuple(names))
    net = LlamaTiny(vocab=256, hidden=hidden, intermediate=2 * hidden)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))
    pm = parallelize(net, mesh, (ids, ids), plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=False)
    pm(ids, ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = [p for p in pm.parameters()]
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    resident = _storage_bytes(params + list(pm.buffers()) + states)
    kept: list[torch.Tensor] = []

    def step() -> None:
        loss = pm(ids, ids)
        loss.backward()
        kept.append(loss)

    measured = resident + peak_new_bytes(step)
    est = rank_memory(pm.graph())
    return {
        "measured": measured,
        "estimated": est.peak,
        "resident_measured": resident,
        "resident_estimated": est.resident,
        "peak_at": est.peak_at,
    }
