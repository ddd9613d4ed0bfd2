"""What an attention kernel whose queries, keys and values are split along the sequence (a
``Shard`` of the sequence dim: ``rules.attention.ring_strategy``) runs on one rank: ring attention
over the process group of that mesh axis, or TokenRing (``backends/context_parallel/tokenring.py``: the queries
travel instead of the keys and values), as ``parallelize(cp={"method": ...})`` asks.

A ``Shard`` holds a contiguous part of the sequence: rank ``r`` of ``cp`` holds chunk ``r``. Under a
causal mask (the kernel's flag, or a mask tensor whose blocks may be hidden whole) that is badly
balanced: the last rank attends to every chunk, the first to its own. So the kernel first moves
the tokens to the zigzag layout (``to_zigzag``: cut in ``2 * cp`` half-chunks, rank ``r`` holds
half-chunks ``r`` and ``2 * cp - 1 - r``, one point-to-point exchange of half of each tensor), runs
the ring there, where every rank has the same work, and moves the results back (``from_zigzag``).
A mask's query rows travel with the queries; its key columns stay whole. Attention without any
mask is balanced as it is and runs on the contiguous parts directly.

Under a mask tensor the kernel first asks where the mask reaches (``backends/context_parallel/ring_reach.py``, one
all-gather of a few integers): whether the zigzag layout balances the work better than the
contiguous one (it does for one long causal sequence; a batch ``meshfold.packing`` packed is
balanced as it lies), and, staying contiguous, what needs to travel at all and how far: key columns
under ring attention, query rows under TokenRing. A mask that hides with its dtype's lowest value
(HF's eager masks) hides with ``-inf`` first (``ring_reach.canonical``: the same weights), so the
blocks it hides whole are skipped too.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from meshfold.backends.context_parallel.ring_attention import RingCall, ring_backward, ring_forward
from meshfold.backends.context_parallel.ring_reach import Reach, Route, canonical, reach
from meshfold.backends.context_parallel.tokenring import tokenring_backward, tokenring_forward

aten = torch.ops.aten


def _owner(half: int, cp: int) -> int:
    """The rank holding half-chunk ``half`` (of ``2 * cp``) in the zigzag layout."""
    return half if half < cp else 2 * cp - 1 - half


def _moved(x: torch.Tensor, group: dist.ProcessGroup, dim: int, forward: bool) -> torch.Tensor:
    """This rank's part of a sequence along ``dim``, from the contiguous layout to the zigzag one
    (``forward``) or back."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    if cp == 1 or x.shape[dim] == 1:  # NOTE: a mask broadcast over its query rows stays as it is
        return x
    zigzag = (r, 2 * cp - 1 - r)
    contiguous = (2 * r, 2 * r + 1)
    held, wanted = (contiguous, zigzag) if forward else (zigzag, contiguous)
    where = (lambda h: _owner(h, cp)) if forward else (lambda h: h // 2)
    source = (lambda h: h // 2) if forward else (lambda h: _owner(h, cp))
    parts = dict(zip(held, x.chunk(2, dim), strict=True))
    got: dict[int, torch.Tensor] = {}
    ops = []
    for h, part in parts.items():
        if where(h) == r:
            got[h] = part
        else:
            ops.append(dist.P2POp(dist.isend, part.contiguous(), dist.get_global_rank(group, where(h)), group, h))
    for h in wanted:
        if h not in got:
            got[h] = torch.empty_like(parts[held[0]].contiguous())
            ops.append(dist.P2POp(dist.irecv, got[h], dist.get_global_rank(group, source(h)), group, h))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return torch.cat([got[h] for h in wanted], dim)


def to_zigzag(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 2) -> torch.Tensor:
    """This rank's contiguous part of a sequence (chunk ``r`` of ``cp``) → its zigzag part."""
    return _moved(x, group, dim, forward=True)


def from_zigzag(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 2) -> torch.Tensor:
    """The inverse of ``to_zigzag``."""
    return _moved(x, group, dim, forward=False)


FORWARD = {"ring": ring_forward, "tokenring": tokenring_forward}
BACKWARD = {"ring": ring_backward, "tokenring": tokenring_backward}


_REACHES: dict[int, tuple[weakref.ref[torch.Tensor], int, str, Reach]] = {}
"""The reach of each mask seen, by its id: the layers of a model read one mask, and the backward
the forward's, so one all-gather serves them all (every rank sees the same masks in the same order,
so every rank finds the same entries). Checked by identity and version; dead entries are dropped."""


def _reached(mask: torch.Tensor, group: str, pg: dist.ProcessGroup) -> Reach:
    """``reach(mask, pg)``, from ``_REACHES`` when this mask, unchanged, was seen on ``group``."""
    hit = _REACHES.get(id(mask))
    if hit is not None and hit[0]() is mask and hit[1:3] == (mask._version, group):
        return hit[3]
    for key in [k for k, v in _REACHES.items() if v[0]() is None]:
        del _REACHES[key]
    found = reach(mask, pg)
    _REACHES[id(mask)] = (weakref.ref(mask), mask._version, group, found)
    return found


def _prepared(
    group: str, is_causal: bool, attn_mask: torch.Tensor | None
) -> tuple[dist.ProcessGroup, str, Route | None, torch.Tensor | None]:
    """The process group named ``group``; where the kernel runs: ``"zigzag"`` (after ``to_zigzag``)
    or ``"contiguous"`` (as the ``Shard`` lies) and, under a mask staying contiguous, the route of
    each rank's keys (ring attention) or queries (TokenRing); and the mask as the kernels read it
    (``ring_reach.canonical``)."""
    pg = _resolve_process_group(group)
    if attn_mask is None:
        return pg, ("zigzag" if is_causal else "contiguous"), None, None
    if is_causal:
        return pg, "zigzag", None, canonical(attn_mask)
    r = _reached(attn_mask, group, pg)
    return pg, r.layout, r.route, canonical(attn_mask)


def kernel_forward(
    group: str,
    method: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's forward, called as the captured graph calls it, as ring attention (or
    TokenRing: ``method``) over the process group named ``group`` on this rank's contiguous part of
    the sequence."""
    assert dropout_p == 0.0, "the sharding rule gives no ring form to dropout"
    forward = FORWARD[method]
    pg, layout, route, attn_mask = _prepared(group, is_causal, attn_mask)
    if layout == "contiguous":
        return forward(query, key, value, RingCall(pg, is_causal, scale, layout, attn_mask, route))
    q, k, v = (to_zigzag(t, pg) for t in (query, key, value))
    mask = None if attn_mask is None else to_zigzag(attn_mask, pg, attn_mask.dim() - 2)
    out, lse = forward(q, k, v, RingCall(pg, is_causal, scale, "zigzag", mask))
    return from_zigzag(out, pg), from_zigzag(lse, pg)


def kernel_backward(
    group: str,
    method: str,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's backward as ``kernel_forward``'s ring."""
    assert dropout_p == 0.0, "the sharding rule gives no ring form to dropout"
    backward = BACKWARD[method]
    pg, layout, route, attn_mask = _prepared(group, is_causal, attn_mask)
    if layout == "contiguous":
        ring = RingCall(pg, is_causal, scale, layout, attn_mask, route)
        return backward(grad_out, query, key, value, out, logsumexp, ring)
    moved = [to_zigzag(t, pg) for t in (grad_out, query, key, value, out, logsumexp)]
    mask = None if attn_mask is None else to_zigzag(attn_mask, pg, attn_mask.dim() - 2)
    grads = backward(*moved, RingCall(pg, is_causal, scale, "zigzag", mask))
    dq, dk, dv = (from_zigzag(g, pg) for g in grads)
    return dq, dk, dv


KERNELS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: kernel_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: kernel_backward,
}
"""The attention kernels a sequence-split layout runs as ring attention."""
