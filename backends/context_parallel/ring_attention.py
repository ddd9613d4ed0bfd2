"""Ring attention over a context-parallel group: each rank holds a slice of the sequence, and the
keys and values travel around the ring while every rank attends its queries to each slice in turn.

Zigzag layout (``sequence_shard``): the sequence is cut in ``2 * cp`` equal chunks and rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r``, so under a causal mask every rank has the same work: an
early chunk, which attends to little, beside a late one, which attends to much (``ring_blocks``
lists the (query chunk, key chunk) pairs each rank computes at each step). The contiguous layout
(rank ``r`` holds chunk ``r`` of ``cp``) is the plain sequence split: the same results, but under a
causal mask the last rank does ``cp`` blocks' work and the first one half of one. Keys and values
may have fewer heads than the queries (grouped-query attention): they travel as they are and are
repeated for each block's kernel, and their gradients summed back over the repeats.

Forward: at step ``s`` a rank holds the keys and values of rank ``r - s`` (mod ``cp``); for each of
its query chunks ``a`` and the held key chunks ``b`` it runs the flash kernel on the pair, whole when
``b`` comes before ``a``, causal when ``b == a``, not at all after (all pairs whole without a causal
mask), and merges the block's output with the running one by their log-sum-exp (online softmax).
The next step's keys and values are sent and received (point to point, ``batch_isend_irecv``)
while the current pairs compute.

Backward: the same pairs in the same order, each through the flash kernel's backward with the
*merged* output and log-sum-exp, which is what makes the per-block gradients add up to the whole:
the query gradients stay, and so do those of a rank's own keys and values; the gradients of the
keys and values it is passed travel with them and, after a last step, arrive back at their owner.

A route (contiguous layout, under a mask; ``backends/context_parallel/ring_reach.py``): a block travels as the
columns some other rank's mask rows see, only as far round the ring as the farthest of them, its
gradients likewise, and from the last rank it reaches they go straight home; a block no other rank
sees does not travel at all. In a batch packed by ``meshfold.packing`` only the chunks of the
sequences split over the ranks go round; under a sliding window, the window's reach, one step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshfold.backends.context_parallel import p2p
from meshfold.backends.context_parallel.ring_reach import Route, Span
from meshfold.ir.dialects.ring import merge, pairs, repeated, summed

aten = torch.ops.aten


@dataclass(frozen=True)
class Block:
    """One attention block a rank computes at one ring step: its query chunk (0 or 1: which of its
    two), the key chunk (0 or 1 of the keys it holds then) and whether the block is causal."""

    query: int
    key: int
    causal: bool


LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True, eq=False)
class RingCall:
    """How one ring attention (or TokenRing) call runs, after its tensors: over ``group``, causal or
    not, the softmax ``scale`` (None: the kernel's), the sequence ``layout`` the parts are held in,
    the ``mask`` rows of this rank's queries, and the ``route`` of what travels (``ring_forward``)."""

    group: dist.ProcessGroup
    causal: bool = True
    scale: float | None = None
    layout: str = "zigzag"
    mask: torch.Tensor | None = None
    route: Route | None = None


def chunks_of(rank: int, cp: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The global chunks that ``rank`` holds: of ``2 * cp`` in the zigzag layout, of ``cp`` in the
    contiguous one."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)


def ring_blocks(rank: int, cp: int, causal: bool, layout: str = "zigzag") -> list[list[Block]]:
    """Per ring step, the blocks ``rank`` computes (step ``s``: the keys of rank ``rank - s``)."""
    mine = chunks_of(rank, cp, layout)
    return [[Block(*b) for b in pairs(mine, chunks_of((rank - s) % cp, cp, layout), causal)] for s in range(cp)]


def sequence_shard(x: torch.Tensor, dim: int, cp: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """``rank``'s part of ``x`` along ``dim`` (the sequence) in ``layout``."""
    mine = chunks_of(rank, cp, layout)
    parts = x.chunk(len(mine) * cp, dim)
    return torch.cat([parts[c] for c in mine], dim)


def sequence_unshard(parts: list[torch.Tensor], dim: int, layout: str = "zigzag") -> torch.Tensor:
    """The whole sequence from every rank's part in ``layout`` (in rank order)."""
    cp = len(parts)
    n = len(chunks_of(0, cp, layout))
    chunks: list[torch.Tensor | None] = [None] * (n * cp)
    for r, p in enumerate(parts):
        for c, piece in zip(chunks_of(r, cp, layout), p.chunk(n, dim), strict=True):
            chunks[c] = piece
    return torch.cat([c for c in chunks if c is not None], dim)


def seq_parts(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``x``'s ``n`` sequence chunks (views)."""
    return list(x.chunk(n, dim=2))


def _span(route: Route | None, rank: int) -> Span | None:
    return None if route is None else route.spans[rank]


def _hops(route: Route | None, rank: int, cp: int) -> int:
    """How far round the ring ``rank``'s keys travel: to every other rank, or as ``route`` says."""
    return cp - 1 if route is None else route.hops[rank]


def _block(like: list[torch.Tensor], span: Span | None) -> list[torch.Tensor]:
    """Empty tensors for a held block of keys and values shaped ``like`` (whole, or ``span``'s)."""
    if span is None:
        return [torch.empty_like(x) for x in like]
    return [x.new_empty(x.shape[0], x.shape[1], span[1] - span[0], x.shape[3]) for x in like]


def _around(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    causal: bool,
    layout: str,
    route: Route | None,
) -> Iterator[tuple[int, list[Block], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], Any]]:
    """Per ring step: the rank whose keys are held, the step's blocks, this rank's query chunks, the
    key and value chunks held then (repeated for the query heads), and which of their block's
    columns they are (``None``: all; the held keys and values themselves at ``[-1]``, None when
    nothing reached this rank at this step: then no blocks); the next step's keys and values are
    on the way meanwhile. With a ``route`` a rank attends to its own keys whole and sends on its
    span only, as far as the route's hops."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    n, times = len(chunks_of(rank, cp, layout)), q.shape[1] // k.shape[1]
    queries, held = seq_parts(q, n), [k, v]
    mine = _span(route, rank)
    travel = held if mine is None else [x[:, :, mine[0] : mine[1]] for x in held]
    for s, step in enumerate(ring_blocks(rank, cp, causal, layout)):
        src, nxt, pending = (rank - s) % cp, (rank - s - 1) % cp, None
        if s < cp - 1:
            send = travel if held and s + 1 <= _hops(route, src, cp) else []
            receive = _block([k, v], _span(route, nxt)) if s + 1 <= _hops(route, nxt, cp) else []
            pending = p2p.start(group, send, (rank + 1) % cp, (rank - 1) % cp, receive=receive)
        if held:
            keys, values = (seq_parts(repeated(x, times), n) for x in held)
            yield src, step, queries, keys, values, (None if s == 0 else _span(route, src), held)
        else:
            yield src, [], queries, [], [], (None, None)
        held = travel = p2p.finish(pending) if pending is not None else []


def mask_part(
    mask: torch.Tensor | None, cp: int, layout: str, queries: int, keys: int, b: Block, span: Span | None = None
) -> Any:
    """The part of a mask block ``b`` reads, for the query rows of rank ``queries`` (``[*, L/cp or 1,
    S]``: every key column) against the keys of rank ``keys`` (their ``span`` of columns only, where
    given): None without a mask, ``SKIP`` for a block it hides whole (never one holding the queries'
    own positions, so every query chunk attends somewhere)."""
    if mask is None:
        return None
    mine = chunks_of(queries, cp, layout)
    rows = mask if mask.shape[-2] == 1 else mask.chunk(len(mine), dim=-2)[b.query]
    key = chunks_of(keys, cp, layout)[b.key]
    m = rows.chunk(len(mine) * cp, dim=-1)[key]
    if span is not None:
        m = m[..., span[0] : span[1]]
    return SKIP if key != mine[b.query] and (m.shape[-1] == 0 or bool(hidden(m).all())) else m


def hidden(m: torch.Tensor) -> torch.Tensor:
    """Per query row of a mask ``[*, L, S]``, whether it hides every key (``[*, L]``)."""
    return ~m.any(-1) if m.dtype == torch.bool else torch.isneginf(m).all(-1)


SKIP = object()
"""``mask_part``'s answer for a block whose mask hides every key from every query."""


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: RingCall,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of ring attention on this rank's part of ``(batch, heads, seq, dim)`` tensors in
    ``layout`` over ``group``: the output and its log-sum-exp ``(batch, heads, seq)``, as the flash
    kernel returns them for the whole sequence. ``mask``: an additive or boolean mask of this
    rank's query rows (or one row for all) over every key column, as the kernel takes it.
    ``route`` (contiguous layout, with a mask): per rank, the columns of its keys other ranks' mask
    rows see and how far round the ring they must go; only those travel, only that far."""
    group, causal, scale, layout, mask, route = ring.group, ring.causal, ring.scale, ring.layout, ring.mask, ring.route
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    n = len(chunks_of(rank, cp, layout))
    outs: list[torch.Tensor | None] = [None] * n
    lses: list[torch.Tensor | None] = [None] * n
    for src, step, queries, keys, values, (span, _) in _around(q, k, v, group, causal, layout, route):
        for b in step:
            m = mask_part(mask, cp, layout, rank, src, b, span)
            if m is SKIP:
                continue
            o, lo, *_ = aten._scaled_dot_product_flash_attention_for_cpu(
                queries[b.query], keys[b.key], values[b.key], 0.0, b.causal, attn_mask=m, scale=scale
            )
            if m is not None:  # NOTE: the kernel gives a row the mask hides whole a log-sum-exp of 0
                lo = lo.masked_fill(hidden(m).expand(lo.shape), -math.inf)
            outs[b.query], lses[b.query] = merge(outs[b.query], lses[b.query], o, lo)
    done = [o for o in outs if o is not None]
    sums = [lv for lv in lses if lv is not None]
    assert len(done) == len(sums) == n, "every query chunk attends at least to itself"
    lse = torch.cat(sums, dim=2)
    return torch.cat(done, dim=2), torch.where(torch.isneginf(lse), 0.0, lse)  # NOTE: as the kernel has it


def ring_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ring: RingCall,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``q``, ``k`` and ``v`` (this rank's parts) from the output's ``grad``, given the
    output and log-sum-exp ``ring_forward`` returned (with the same ``mask`` and ``route``)."""
    group, causal, scale, layout, mask, route = ring.group, ring.causal, ring.scale, ring.layout, ring.mask, ring.route
    times, cp, rank = q.shape[1] // k.shape[1], dist.get_world_size(group), dist.get_rank(group)
    n = len(chunks_of(rank, cp, layout))
    outs, lses, grads = seq_parts(out, n), seq_parts(lse, n), seq_parts(grad.contiguous(), n)
    dq = [torch.zeros_like(x) for x in seq_parts(q, n)]
    home = [torch.zeros_like(k), torch.zeros_like(v)]
    # NOTE: a rank's own block's gradients stay home; those of a block it is passed travel on with
    # it (what the ranks before added arrives with the keys), and the last rank it reaches sends
    # them straight home
    coming, homes = None, []
    for s, (src, step, queries, keys, values, (span, held)) in enumerate(
        _around(q, k, v, group, causal, layout, route)
    ):
        got = p2p.finish(coming) if coming is not None else []
        if held is None:
            acc: list[torch.Tensor] = []
        elif s == 0:
            acc = home
        else:  # NOTE: the first rank a block is passed to starts its gradients
            acc = got or [torch.zeros_like(x) for x in held]
        for b in step:
            m = mask_part(mask, cp, layout, rank, src, b, span)
            if m is SKIP:
                continue
            gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grads[b.query],
                queries[b.query],
                keys[b.key],
                values[b.key],
                outs[b.query],
                lses[b.query],
                0.0,
                b.causal,
                attn_mask=m,
                scale=scale,
            )
            dq[b.query] = dq[b.query] + gq
            seq_parts(acc[0], n)[b.key].add_(summed(gk, times))
            seq_parts(acc[1], n)[b.key].add_(summed(gv, times))
        nxt, last = (rank - s - 1) % cp, _hops(route, src, cp)
        on = acc if s > 0 and s < last else []
        receive = _block(home, _span(route, nxt)) if 0 < s < _hops(route, nxt, cp) else []
        coming = p2p.start(group, on, (rank + 1) % cp, (rank - 1) % cp, tag=1, receive=receive)
        if acc and s > 0 and s == last:
            homes.append(p2p.start(group, acc, src, src, tag=2, receive=[]))
    if coming is not None:
        p2p.finish(coming)
    far = _hops(route, rank, cp)
    if far > 0:
        back = p2p.finish(
            p2p.start(group, [], rank, (rank + far) % cp, tag=2, receive=_block(home, _span(route, rank)))
        )
        mine = _span(route, rank)
        for h, x in zip(home, back, strict=True):
            (h if mine is None else h[:, :, mine[0] : mine[1]]).add_(x)
    for pending in homes:
        p2p.finish(pending)
    return torch.cat(dq, dim=2), home[0], home[1]


class RingAttention(torch.autograd.Function):
    """``ring_forward`` with ``ring_backward`` as its gradient (see the module doc)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup,
        causal: bool,
        scale: float | None,
        layout: str,
        mask: torch.Tensor | None,
        route: Route | None,
    ) -> torch.Tensor:
        ring = RingCall(group, causal, scale, layout, mask, route)
        out, lse = ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return (*ring_backward(grad, *ctx.saved_tensors, ctx.ring), None, None, None, None, None, None)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    causal: bool = True,
    scale: float | None = None,
    layout: str = "zigzag",
    mask: torch.Tensor | None = None,
    route: Route | None = None,
) -> torch.Tensor:
    """Attention of this rank's part (in ``layout``) of the queries over every rank's keys and
    values; ``k`` and ``v`` may have fewer heads than ``q`` (a divisor of its heads). ``mask``: the
    rows of this rank's queries (in ``layout``) of a mask over every key (in sequence order);
    ``route``: what travels of each rank's keys, and how far (``ring_forward``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"ring attention: {q.shape[1]} query heads over {k.shape[1]} key and {v.shape[1]} value heads; the "
            "keys and values need one head count that divides the queries'"
        )
    out: torch.Tensor = RingAttention.apply(q, k, v, group, causal, scale, layout, mask, route)
    return out
