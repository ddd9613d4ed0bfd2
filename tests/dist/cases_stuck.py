"""Tasks for tests/dist/test_stuck.py: a rank that stops answering surfaces on the others within the
module's timeout, as an error naming the collective, the op and the mesh axis."""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from meshfold import CollectiveError, parallelize
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build

STUCK = 3


def _failure(call: Any) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        call()
    except CollectiveError as e:
        return str(e), time.perf_counter() - start
    raise AssertionError("the call did not fail")


def stuck_rank(wait: float = 2.0, sleep: float = 4.0) -> dict[str, Any]:
    """Rank 3 sleeps before a call, then inside the program; the others' errors and waits."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    model, (x, y) = build("mlp")
    pm = parallelize(model, mesh, (x, y), plan="fsdp+tp", timeout=wait)
    dist.barrier()  # NOTE: see the second part's note
    pm(x, y).backward()  # NOTE: a normal step first
    me = dist.get_rank()

    def late() -> None:
        if me == STUCK:
            time.sleep(sleep)
        pm(x, y)

    said: dict[str, Any] = {"before a call": _failure(late)}
    # NOTE: a fresh module (its groups are fresh too); rank 3 stalls inside the program this time
    pm2 = parallelize(build("mlp")[0], mesh, (x, y), plan="fsdp+tp", timeout=wait)
    if me == STUCK:
        program = pm2._mf_programs.first
        run = program.lowered.forward

        def slow(*tensors: torch.Tensor) -> Any:
            time.sleep(sleep)
            return run(*tensors)

        program.lowered = dataclasses.replace(program.lowered, forward=slow)
    # NOTE: rank 3 comes out of the first failure late, and compiling pm2 takes each rank its own time
    # on a loaded machine: the ranks meet on the world group (no short timeout) so that the call check
    # passes and rank 3 stalls where this part means it to, inside the program
    dist.barrier()
    said["inside the program"] = _failure(lambda: pm2(x, y))
    return said
