"""Tasks for tests/dist/test_ring.py: ring attention over all ranks against one device's attention."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshfold.backends.ring import ring_attention, ring_forward, sequence_shard, sequence_unshard


def ring_equals_attention(
    batch: int,
    heads: int,
    seq: int,
    dim: int,
    causal: bool,
    group_size: int | None = None,
    kv_heads: int | None = None,
    layout: str = "zigzag",
) -> dict[str, Any]:
    """Queries, keys and values (``kv_heads`` of them: grouped-query attention) drawn alike on every
    rank, each rank's part in ``layout`` through ``ring_attention`` over the world (or over groups of
    ``group_size`` consecutive ranks), the output and the gradients of a random cotangent gathered
    back to the whole sequence: their largest differences from ``scaled_dot_product_attention`` on
    one device."""
    g = torch.Generator().manual_seed(0)
    kvh = kv_heads or heads
    q, k, v, dout = (
        torch.randn(batch, h, seq, dim, generator=g, dtype=torch.float64) for h in (heads, kvh, kvh, heads)
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    size = group_size or world
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    group, cp, me = groups[rank // size], size, rank % size
    parts = [sequence_shard(x, 2, cp, me, layout).clone().requires_grad_(True) for x in (q, k, v)]
    out = ring_attention(*parts, group=group, causal=causal, layout=layout)
    out.backward(sequence_shard(dout, 2, cp, me, layout))
    got = [out.detach(), *(p.grad for p in parts)]
    whole = []
    for x in got:
        assert x is not None
        pieces = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        whole.append(sequence_unshard(pieces, 2, layout))
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=kvh != heads)
    want.backward(dout)
    expected = [want.detach(), *(t.grad for t in ref)]
    names = ("out", "dq", "dk", "dv")
    errs = {n: float((a - b).abs().max()) for n, a, b in zip(names, whole, expected, strict=True)}
    # NOTE: the log-sum-exp the forward returns (what the backward op reads) is the whole sequence's
    _, lse = ring_forward(*(p.detach() for p in parts), group=group, causal=causal, layout=layout)
    pieces = [torch.empty_like(lse) for _ in range(cp)]
    dist.all_gather(pieces, lse.contiguous(), group=group)
    reps = heads // kvh
    full_k, full_v = k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1)
    _, want_lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, full_k, full_v, 0.0, causal)
    errs["lse"] = float((sequence_unshard(pieces, 2, layout) - want_lse).abs().max())
    return errs
