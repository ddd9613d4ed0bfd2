"""Running sums and flips along a split dim, as one rank computes its part of them.

A running sum (``cumsum``) along a dim split over a mesh axis: each rank sums its part, then adds
the totals of the ranks before it. One all-gather of every rank's total (its last row) brings
them; for linear attention that total is the memory state ``sum_s k_s v_s^T``, whose size does not
depend on the sequence: LASP-2's one all-gather of memory states. The backward of a running sum
is flip, running sum, flip; a flip along a split dim flips each rank's part and swaps it with the
rank mirroring it on the axis.

A linear recurrence (``meshfold.affine_scan``, ``h_{i+1} = m_i h_i + b_i``) split along its steps
works the same way with a matrix in place of the sum: each rank folds its steps into one
``(p, c)`` pair, one all-gather brings every rank's pair (the state's size, whatever the sequence),
each composes the pairs of the ranks before it onto the first state and runs its own steps from
there. The backward runs the transposed recurrence from the last rank down.

Every exchange here is a functional collective (``torch.ops._c10d_functional``) of the tensors'
bytes, so a compiler that traces a rank's program (Inductor) takes these helpers as it takes the
lowered comm ops; the recurrence's own steps run as the op ``meshfold.affine_scan``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from meshfold.ir.dialects.scan import SCAN, composite, scan_back, step

c10d = torch.ops._c10d_functional


def _group(name: str) -> tuple[int, int]:
    """(size, this rank's place) of the process group named ``name``."""
    pg = _resolve_process_group(name)
    return dist.get_world_size(pg), dist.get_rank(pg)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bytes, flat: what crosses the wire whatever the dtype (gloo's collectives take fewer
    dtypes than its sends did)."""
    return x.contiguous().view(-1).view(torch.uint8)


def _every(group: str, x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` (alike in shape) in rank order, by one all-gather."""
    n, _ = _group(group)
    out = c10d.wait_tensor(c10d.all_gather_into_tensor(_bytes(x), n, group))
    return list(out.view(x.dtype).view(n, *x.shape).unbind(0))


def cumsum_split(group: str, x: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.cumsum(x, dim)`` of the whole tensor, on this rank's part of ``dim`` split over the
    process group named ``group`` (rank order = order along ``dim``)."""
    y = torch.cumsum(x, dim, dtype=dtype)
    totals = _every(group, y.narrow(dim, y.shape[dim] - 1, 1))
    _, r = _group(group)
    if r == 0:
        return y
    before = totals[0]
    for t in totals[1:r]:
        before = before + t
    return y + before


def flip_split(groups: tuple[str, ...], x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """``torch.flip(x, dims)`` of the whole tensor, on this rank's part, where ``groups`` name the
    process groups of the mesh axes that split a flipped dim: each swaps parts with its mirror (an
    all-to-all that sends this rank's whole part to the mirror and nothing to the others)."""
    y = torch.flip(x, dims)
    for name in groups:
        n, r = _group(name)
        peer = n - 1 - r
        if peer == r:
            continue
        sent = _bytes(y)
        sizes = [sent.numel() if j == peer else 0 for j in range(n)]
        y = c10d.wait_tensor(c10d.all_to_all_single(sent, sizes, sizes, name)).view(y.dtype).view(y.shape)
    return y


def _pairs(group: str, p: torch.Tensor, c: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``(p, c)`` in rank order, by one all-gather."""
    k = p.shape[-1]
    return [(t[..., :k], t[..., k:]) for t in _every(group, torch.cat([p, c], -1))]


def affine_scan_split(
    group: str, m: torch.Tensor, b: torch.Tensor, s0: torch.Tensor, diagonal: bool = False
) -> torch.Tensor:
    """``affine_scan(m, b, s0, diagonal)`` on this rank's steps, the steps split over the process
    group named ``group`` in rank order."""
    p, c = composite(m, b, diagonal)
    assert c is not None
    s = s0
    for p_before, c_before in _pairs(group, p, c)[: _group(group)[1]]:
        s = step(p_before, s, diagonal) + c_before
    out: torch.Tensor = SCAN(m, b, s, diagonal)
    return out


def affine_scan_backward_split(
    group: str, m: torch.Tensor, h: torch.Tensor, grad: torch.Tensor, diagonal: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``affine_scan_backward`` on this rank's steps: the gradient of the state after them comes
    from the ranks after this one (the transposed recurrence, folded the same way); ``ds0`` is the
    first rank's, zero on the others (their sum is the whole)."""
    r = _group(group)[1]
    zero = torch.zeros_like(h[..., 0, :, :])
    p, _ = composite(m, None, diagonal)
    _, _, c = scan_back(m, h, grad, zero, diagonal)
    g = zero
    for p_after, c_after in reversed(_pairs(group, p, c)[r + 1 :]):
        g = step(p_after if diagonal else p_after.mT, g, diagonal) + c_after
    dm, db, ds0 = scan_back(m, h, grad, g, diagonal)
    return dm, db, ds0 if r == 0 else torch.zeros_like(ds0)
