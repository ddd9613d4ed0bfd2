"""Rank tasks for tests/dist/test_calibrate.py: a profiled step of collectives for the refit."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

MIB = 2**20


def profiled_all_reduces(path: str, sizes: tuple[int, ...] = (4 * MIB, 8 * MIB, 16 * MIB)) -> int:
    """Profile (with shapes) two all-reduces of each size in bytes over the world, as compiled
    programs issue them; rank 0 writes the Chrome trace to ``path``. Returns the rank."""
    ops = torch.ops._c10d_functional
    group = dist.group.WORLD
    assert group is not None
    xs = [torch.rand(n // 4) for n in sizes]
    ops.wait_tensor(ops.all_reduce(xs[0], "sum", group.group_name))  # NOTE: warm-up outside the profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for x in xs * 2:
            ops.wait_tensor(ops.all_reduce(x, "sum", group.group_name))
    if dist.get_rank() == 0:
        prof.export_chrome_trace(str(Path(path)))
    dist.barrier()
    return dist.get_rank()
