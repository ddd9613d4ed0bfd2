"""Running sums and flips along a split dim, as one rank computes its part of them.

A running sum (``cumsum``) along a dim split over a mesh axis: each rank sums its part, then adds
the totals of the ranks before it. One all-gather of every rank's total (its last row) brings
them; for linear attention that total is the memory state ``sum_s k_s v_s^T``, whose size does not
depend on the sequence: LASP-2's one all-gather of memory states. The backward of a running sum
is flip, running sum, flip; a flip along a split dim flips each rank's part and swaps it with the
rank mirroring it on the axis (point to point).

A linear recurrence (``meshfold.affine_scan``, ``h_{i+1} = m_i h_i + b_i``) split along its steps
works the same way with a matrix in place of the sum: each rank folds its steps into one
``(p, c)`` pair, one all-gather brings every rank's pair (the state's size, whatever the sequence),
each composes the pairs of the ranks before it onto the first state and runs its own steps from
there. The backward runs the transposed recurrence from the last rank down.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from meshfold.backends import p2p
from meshfold.ir.scan import composite, scan, scan_back, step


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


def _pairs(pg: dist.ProcessGroup, p: torch.Tensor, c: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``(p, c)`` in rank order, by one all-gather."""
    k = p.shape[-1]
    mine = torch.cat([p, c], -1).contiguous()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(every, mine, group=pg)
    return [(t[..., :k], t[..., k:]) for t in every]


def affine_scan_split(
    group: str, m: torch.Tensor, b: torch.Tensor, s0: torch.Tensor, diagonal: bool = False
) -> torch.Tensor:
    """``affine_scan(m, b, s0, diagonal)`` on this rank's steps, the steps split over the process
    group named ``group`` in rank order."""
    pg = _resolve_process_group(group)
    p, c = composite(m, b, diagonal)
    assert c is not None
    s = s0
    for p_before, c_before in _pairs(pg, p, c)[: dist.get_rank(pg)]:
        s = step(p_before, s, diagonal) + c_before
    return scan(m, b, s, diagonal)


def affine_scan_backward_split(
    group: str, m: torch.Tensor, h: torch.Tensor, grad: torch.Tensor, diagonal: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``affine_scan_backward`` on this rank's steps: the gradient of the state after them comes
    from the ranks after this one (the transposed recurrence, folded the same way); ``ds0`` is the
    first rank's, zero on the others (their sum is the whole)."""
    pg = _resolve_process_group(group)
    zero = torch.zeros_like(h[..., 0, :, :])
    p, _ = composite(m, None, diagonal)
    _, _, c = scan_back(m, h, grad, zero, diagonal)
    g = zero
    for p_after, c_after in reversed(_pairs(pg, p, c)[dist.get_rank(pg) + 1 :]):
        g = step(p_after if diagonal else p_after.mT, g, diagonal) + c_after
    dm, db, ds0 = scan_back(m, h, grad, g, diagonal)
    return dm, db, ds0 if dist.get_rank(pg) == 0 else torch.zeros_like(ds0)
