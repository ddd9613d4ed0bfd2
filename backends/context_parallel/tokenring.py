"""TokenRing: context-parallel attention that moves the queries instead of the keys and values.

Each rank keeps its keys and values. At step ``s`` rank ``r`` receives the queries of rank
``r - s`` (with what the blocks need of them) straight from their owner, attends them to its own
keys and values, and sends the blocks' output and log-sum-exp straight back, while its own queries
are at rank ``r + s`` and their results come back from there: queries travel one way and results
the other, at once, between every pair of ranks (a fully connected topology, as NVLink and HCCS
give). The owner merges the results by their log-sum-exp as ring attention does. The next step's
queries are on their way while the current blocks compute. Backward: the queries travel with the
output, its gradient and log-sum-exp; the key and value gradients stay where the keys are and the
query gradients go home.

Same layouts, blocks and masks as ``backends/context_parallel/ring_attention.py`` (zigzag or contiguous,
grouped-query keys,
a mask split by its query rows, which travel with the queries). On a route
(``backends/context_parallel/ring_reach.py``: a mask on the contiguous layout) a rank's queries go only to the ranks
whose keys they see, and only the rows that see them; their results come back for those rows. It
sends the queries and the outputs where ring attention sends keys and values: less with as many
key heads as query heads, more with grouped-query keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from meshfold.backends.context_parallel import p2p
from meshfold.backends.context_parallel.ring_attention import (
    SKIP,
    Block,
    RingCall,
    chunks_of,
    hidden,
    mask_part,
    ring_blocks,
    seq_parts,
)
from meshfold.backends.context_parallel.ring_reach import Route, Span
from meshfold.ir.dialects.ring import merge, repeated, summed

aten = torch.ops.aten


def _sent(route: Route | None, owner: int, dest: int) -> Span | None:
    """The rows of ``owner``'s queries that travel to ``dest`` (None: all of them)."""
    return None if route is None else route.queries[owner][dest]


def _cut(ts: list[torch.Tensor], span: Span | None, masked: bool) -> list[torch.Tensor]:
    """The ``span`` of rows of each travelling tensor: dim 2, and a mask's (the last, when
    ``masked``) second-to-last."""
    if span is None:
        return ts
    last = len(ts) - 1
    dims = [t.dim() - 2 if masked and i == last else 2 for i, t in enumerate(ts)]
    return [t.narrow(d, span[0], span[1] - span[0]) for t, d in zip(ts, dims, strict=True)]


def _steps(
    travelling: list[torch.Tensor],
    masked: bool,
    group: dist.ProcessGroup,
    causal: bool,
    layout: str,
    route: Route | None,
) -> Iterator[tuple[int, int, list[Block], list[torch.Tensor]]]:
    """Per step ``s``: ``s``, the rank whose queries (and what travels with them) are held, the blocks
    they make with this rank's keys (none when no row came), and the held tensors; the next step's
    are on the way meanwhile. With a ``route`` only the rows that see the keys they meet travel."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    held, pending = travelling, None
    for s in range(cp):
        if pending is not None:
            held = p2p.finish(pending)
        pending = None
        if s + 1 < cp:
            dest, frm = (r + s + 1) % cp, (r - s - 1) % cp
            send = _cut(travelling, _sent(route, r, dest), masked)
            receive = [t.new_empty(t.shape) for t in _cut(travelling, _sent(route, frm, r), masked)]
            pending = p2p.start(group, send, dest, frm, 2 * s, receive=receive)
        src = (r - s) % cp
        # NOTE: src's queries meet this rank's keys at src's ring step (src - r) % cp
        blocks = ring_blocks(src, cp, causal, layout)[(src - r) % cp] if held[0].shape[2] else []
        yield s, src, blocks, held


def _home(group: dist.ProcessGroup, s: int, results: list[torch.Tensor], route: Route | None) -> p2p.Pending:
    """Step ``s``'s results to the queries' owner; this rank's own (for the rows it sent) from where
    its queries are."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    span = _sent(route, r, (r + s) % cp)
    receive = None if span is None else [x.new_empty(*x.shape[:2], span[1] - span[0], *x.shape[3:]) for x in results]
    return p2p.start(group, results, (r - s) % cp, (r + s) % cp, 2 * s + 1, receive=receive)


def _rows(mask: torch.Tensor | None) -> list[torch.Tensor]:
    """What of a mask travels with the queries: its query rows, unless broadcast over them."""
    return [mask] if mask is not None and mask.shape[-2] != 1 else []


def tokenring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: RingCall,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ring.ring_forward``'s output and log-sum-exp, the queries travelling instead of the keys
    (with a ``route``, contiguous layout: only the rows that see the keys they meet)."""
    group, causal, scale, layout, mask, route = ring.group, ring.causal, ring.scale, ring.layout, ring.mask, ring.route
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    n, times = len(chunks_of(r, cp, layout)), q.shape[1] // k.shape[1]
    keys, values = seq_parts(repeated(k, times), n), seq_parts(repeated(v, times), n)
    outs: list[torch.Tensor | None] = [None] * n
    lses: list[torch.Tensor | None] = [None] * n
    coming = []

    def take(o: torch.Tensor, lo: torch.Tensor, span: Span | None = None) -> None:
        if span is None:
            for i, (x, y) in enumerate(zip(seq_parts(o, n), seq_parts(lo, n), strict=True)):
                outs[i], lses[i] = merge(outs[i], lses[i], x, y)
            return
        whole, sums = outs[0], lses[0]  # NOTE: a route: one part, whole after step 0
        assert whole is not None and sums is not None
        a, b = span
        whole[:, :, a:b], sums[:, :, a:b] = merge(whole[:, :, a:b], sums[:, :, a:b], o, lo)

    rows_of = _rows(mask)
    for s, src, blocks, held in _steps([q, *rows_of], bool(rows_of), group, causal, layout, route):
        rows = held[1] if len(held) > 1 else mask
        queries = seq_parts(held[0], n)
        o = [torch.zeros(*x.shape[:-1], v.shape[-1], dtype=x.dtype) for x in queries]
        lo: list[torch.Tensor] = []
        for x in queries:  # NOTE: a chunk no block reaches sends an empty result: output 0, weight 0
            lo.append(torch.full(x.shape[:-1], -math.inf, dtype=x.dtype))
        for b in blocks:
            m = mask_part(rows, cp, layout, src, r, b)
            if m is SKIP:
                continue
            bo, bl, *_ = aten._scaled_dot_product_flash_attention_for_cpu(
                queries[b.query], keys[b.key], values[b.key], 0.0, b.causal, attn_mask=m, scale=scale
            )
            if m is not None:
                bl = bl.masked_fill(hidden(m).expand(bl.shape), -math.inf)
            o[b.query], lo[b.query] = merge(o[b.query], lo[b.query].to(bl.dtype), bo, bl)
        results = [torch.cat(o, dim=2), torch.cat(lo, dim=2)]
        if s == 0:
            take(*results)
        else:
            coming.append((_home(group, s, results, route), _sent(route, r, (r + s) % cp)))
    for pending, span in coming:
        take(*p2p.finish(pending), span)
    out = torch.cat([t for t in outs if t is not None], dim=2)
    lse = torch.cat([t for t in lses if t is not None], dim=2)
    return out, torch.where(torch.isneginf(lse), 0.0, lse)


def tokenring_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ring: RingCall,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ring.ring_backward``'s gradients, the queries (with the output, its gradient and its
    log-sum-exp) travelling and the query gradients coming home (with a ``route``: for the rows
    that see the keys they meet)."""
    group, causal, scale, layout, mask, route = ring.group, ring.causal, ring.scale, ring.layout, ring.mask, ring.route
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    n, times = len(chunks_of(r, cp, layout)), q.shape[1] // k.shape[1]
    keys, values = seq_parts(repeated(k, times), n), seq_parts(repeated(v, times), n)
    dks, dvs = [torch.zeros_like(x) for x in keys], [torch.zeros_like(x) for x in values]
    dq = torch.zeros_like(q)
    coming = []
    travelling = [grad.contiguous(), q, out, lse, *_rows(mask)]
    for s, src, blocks, held in _steps(travelling, len(travelling) > 4, group, causal, layout, route):
        rows = held[4] if len(held) > 4 else mask
        grads, queries, outs, lses = (seq_parts(t, n) for t in held[:4])
        gq = torch.zeros_like(held[1])
        gqs = seq_parts(gq, n)
        for b in blocks:
            m = mask_part(rows, cp, layout, src, r, b)
            if m is SKIP:
                continue
            bq, bk, bv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grads[b.query], queries[b.query], keys[b.key], values[b.key], outs[b.query], lses[b.query],
                0.0, b.causal, attn_mask=m, scale=scale,
            )  # fmt: skip
            gqs[b.query].add_(bq)
            dks[b.key].add_(bk)
            dvs[b.key].add_(bv)
        if s == 0:
            dq.add_(gq)
        else:
            coming.append((_home(group, s, [gq], route), _sent(route, r, (r + s) % cp)))
    for pending, span in coming:
        back = p2p.finish(pending)[0]
        (dq if span is None else dq[:, :, span[0] : span[1]]).add_(back)
    return dq, summed(torch.cat(dks, dim=2), times), summed(torch.cat(dvs, dim=2), times)
