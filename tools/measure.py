"""Measured memory of a rank: the CPU allocator's own count, read through torch.profiler.

The multi-rank memory tests and the overlap bench measure peaks the same way, here.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


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


def _walk(nodes: list[Any]) -> Iterator[Any]:
    for n in nodes:
        yield n
        yield from _walk(n.children)


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


def settled_peak_new_bytes(
    fn: Callable[[], object], runs: int = 2, settle_s: float = 0.05, before: Callable[[], object] | None = None
) -> int:
    """The lowest ``peak_new_bytes(fn)`` over ``runs`` runs, each after ``before()`` (not measured)
    and ``settle_s`` of sleep.

    gloo's worker thread lets go of a finished collective's tensors only after the wait has
    returned, at times milliseconds later with several ranks per core. Freed during the next run,
    such a buffer lowers that run's count; still held at its peak, it raises it. The sleep lets
    the first settle before a run, and of several runs the lowest has most likely missed the
    second (which only adds)."""
    peaks = []
    for _ in range(runs):
        if before is not None:
            before()
        time.sleep(settle_s)
        peaks.append(peak_new_bytes(fn))
    return min(peaks)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct local storages behind ``tensors`` (DTensors count their shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        s = local.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def train_step(model: Any, inputs: tuple[torch.Tensor, ...]) -> float:
    """One forward + backward of ``model`` (returning its loss) from cleared gradients; the loss."""
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    loss = loss.detach()
    return float(loss.to_local() if hasattr(loss, "to_local") else loss)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one intra-op thread (a one-device baseline beside ranks that have one each),
    and restore the thread count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def timed_steps(model: Any, inputs: tuple[torch.Tensor, ...], steps: int, barrier: bool) -> tuple[list[float], float]:
    """Wall times of ``steps`` :func:`train_step` calls after one warm-up call, and the last loss;
    ``barrier``: every rank starts and ends each step together (``torch.distributed.barrier``)."""
    import torch.distributed as dist

    loss = train_step(model, inputs)
    times = []
    for _ in range(steps):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        loss = train_step(model, inputs)
        if barrier:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    return times, loss
