"""Running sums and flips along a split dim, as one rank computes its part of them.

A running sum (``cumsum``) along a dim split over a mesh axis: each rank sums its part, then adds
the totals of the ranks before it. One all-gather of every rank's total (its last row) brings
them; for linear attention that total is the memory state ``sum_s k_s v_s^T``, whose size does not
depend on the sequence: LASP-2's one all-gather of memory states. The backward of a running sum
is flip, running sum, flip; a flip along a split dim flips each rank's part and swaps it with the
rank mirroring it on the axis (point to point).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from meshfold.backends import p2p


def cumsum_split(group: str, x: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.cumsum(x, dim)`` of the whole tensor, on this rank's part of ``dim`` split over the
    process group named ``group`` (rank order = order along ``dim``)."""
    pg = _resolve_process_group(group)
    y = torch.cumsum(x, dim, dtype=dtype)
    n, r = dist.get_world_size(pg), dist.get_rank(pg)
    last = y.narrow(dim, y.shape[dim] - 1, 1).contiguous()
    totals = [torch.empty_like(last) for _ in range(n)]
    dist.all_gather(totals, last, group=pg)
    if r == 0:
        return y
    before = totals[0]
    for t in totals[1:r]:
        before = before + t
    return y + before


def flip_split(groups: tuple[str, ...], x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """``torch.flip(x, dims)`` of the whole tensor, on this rank's part, where ``groups`` name the
    process groups of the mesh axes that split a flipped dim: each swaps parts with its mirror."""
    y = torch.flip(x, dims)
    for name in groups:
        pg = _resolve_process_group(name)
        n, r = dist.get_world_size(pg), dist.get_rank(pg)
        peer = n - 1 - r
        if peer == r:
            continue
        (y,) = p2p.finish(p2p.start(pg, [y], peer, peer))
    return y
