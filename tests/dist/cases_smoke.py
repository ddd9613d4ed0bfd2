"""Tasks for tests/dist/test_pool.py: they run on the ranks of a ``RankPool`` and prove the harness works."""

from __future__ import annotations

import faulthandler
import os
import threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshfold.tools.pool_worker import device_mesh


def _default_group_name() -> str:
    """Name of the default process group, as functional collectives want it."""
    return dist.distributed_c10d._get_default_group().group_name


def rank_and_world() -> tuple[int, int]:
    """This rank and the world size, as the process group sees them."""
    return dist.get_rank(), dist.get_world_size()


def functional_collectives(n: int) -> dict[str, torch.Tensor]:
    """all_reduce, all_gather_into_tensor and reduce_scatter_tensor (``_c10d_functional``) on the default group.

    Rank r contributes ``arange(n * world) + 100 * r``; the caller computes the expected values.
    """
    ops = torch.ops._c10d_functional
    group, world = _default_group_name(), dist.get_world_size()
    mine = torch.arange(n * world, dtype=torch.float32) + 100 * dist.get_rank()
    return {
        "all_reduce": ops.wait_tensor(ops.all_reduce(mine, "sum", group)),
        "all_gather": ops.wait_tensor(ops.all_gather_into_tensor(mine, world, group)),
        "reduce_scatter": ops.wait_tensor(ops.reduce_scatter_tensor(mine, "sum", world, group)),
    }


def mesh_2d_sums() -> dict[str, object]:
    """On a (2, 2) ``("dp", "tp")`` mesh: this rank's coordinate and the sum of ranks over each mesh dim."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ops = torch.ops._c10d_functional
    mine = torch.tensor([float(dist.get_rank())])
    sums = {
        name: ops.wait_tensor(ops.all_reduce(mine, "sum", mesh.get_group(name).group_name)).item()
        for name in ("dp", "tp")
    }
    return {"coordinate": tuple(mesh.get_coordinate() or ()), **sums}


def cached_mesh_groups() -> tuple[str, str]:
    """Group names of the worker's cached (2, 2) mesh, after a ``tp`` all_reduce over it."""
    mesh = device_mesh((2, 2), ("dp", "tp"))
    dist.all_reduce(torch.ones(1), group=mesh.get_group("tp"))
    return mesh.get_group("dp").group_name, mesh.get_group("tp").group_name


def raise_on(rank: int) -> int:
    """Raise a recognisable error on ``rank`` only; other ranks return their rank."""
    if dist.get_rank() == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    return dist.get_rank()


def raise_before_collective(rank: int) -> None:
    """``rank`` raises; every other rank enters an all_reduce that can never complete."""
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} raised before the all_reduce")
    dist.all_reduce(torch.ones(1))


def skip_collective(rank: int) -> None:
    """Every rank but ``rank`` enters an all_reduce, so those ranks hang."""
    if dist.get_rank() != rank:
        dist.all_reduce(torch.ones(1))


def exit_on(rank: int, code: int) -> None:
    """``rank`` exits its process abruptly; the others return."""
    if dist.get_rank() == rank:
        os._exit(code)


def crash_on(rank: int) -> None:
    """``rank`` dies of a segmentation fault (as a crash in native code would); the others return."""
    if dist.get_rank() == rank:
        faulthandler._sigsegv()


def unfinished_collective_then_raise(rank: int) -> None:
    """Every rank but ``rank`` issues an async all_reduce it never waits for; ``rank`` raises instead."""
    if dist.get_rank() == rank:
        raise ValueError("raised while the others left a collective pending")
    dist.all_reduce(torch.ones(1), async_op=True)


def send_to_next() -> int:
    """Rank 0 sends a tensor to rank 1, which receives it: only these two ranks count the transfer
    in their group's collective sequence. Returns what this rank holds."""
    t = torch.full((2,), float(dist.get_rank()))
    if dist.get_rank() == 0:
        dist.send(t, 1)
    elif dist.get_rank() == 1:
        dist.recv(t, 0)
    return int(t[0].item())


def unpicklable_result() -> object:
    """Return something pickle refuses (a lock)."""
    return threading.Lock()


def echo(**kwargs: object) -> dict[str, object]:
    """Return the keyword arguments received, to show what the pool forwards."""
    return dict(kwargs)


def print_and_return(text: str) -> int:
    """Print ``text`` (the parent relays it as ``[rank r] ...``) and return the rank."""
    print(f"{text} from {dist.get_rank()}")
    return dist.get_rank()
