"""Tasks for tests/dist/test_ring.py: ring attention over all ranks against one device's attention."""

from __future__ import annotations

import operator
import os
import sys
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshfold.backends.context_parallel import p2p
from meshfold.backends.context_parallel.ring_attention import (
    RingCall,
    ring_attention,
    ring_forward,
    sequence_shard,
    sequence_unshard,
)
from meshfold.backends.context_parallel.ring_reach import reach
from meshfold.backends.context_parallel.tokenring import tokenring_backward, tokenring_forward


def ring_equals_attention(
    batch: int,
    heads: int,
    seq: int,
    dim: int,
    causal: bool,
    group_size: int | None = None,
    kv_heads: int | None = None,
    layout: str = "zigzag",
    window: int | None = None,
    method: str = "ring",
    routed: bool = False,
) -> dict[str, Any]:
    """Queries, keys and values (``kv_heads`` of them: grouped-query attention) drawn alike on every
    rank, each rank's part in ``layout`` through ``ring_attention`` over the world (or over groups of
    ``group_size`` consecutive ranks), the output and the gradients of a random cotangent gathered
    back to the whole sequence: their largest differences from ``scaled_dot_product_attention`` on
    one device. ``window``: a causal sliding-window mask (each query sees itself and the ``window - 1``
    keys before it) in place of ``causal``, as an additive mask each rank holds its query rows of.
    ``method="tokenring"``: ``tokenring_forward`` and ``tokenring_backward`` instead. ``routed``: ring
    attention on the route ``ring_reach`` finds for the mask (only the key columns other ranks see
    travel, only as far as they are seen), and the elements it sent (keys, values and their
    gradients, forward and backward) beside what the whole blocks to every rank would send."""
    g = torch.Generator().manual_seed(0)
    kvh = kv_heads or heads
    q, k, v, dout = (
        torch.randn(batch, h, seq, dim, generator=g, dtype=torch.float64) for h in (heads, kvh, kvh, heads)
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    size = group_size or world
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    group, cp, me = groups[rank // size], size, rank % size
    mask = None
    if window is not None:
        i = torch.arange(seq)
        seen = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        mask = torch.zeros(seq, seq, dtype=torch.float64).masked_fill(~seen, float("-inf"))
    parts = [sequence_shard(x, 2, cp, me, layout).clone().requires_grad_(True) for x in (q, k, v)]
    rows = None if mask is None else sequence_shard(mask[None, None], 2, cp, me, layout)
    grad = sequence_shard(dout, 2, cp, me, layout)
    sent = [0]
    start = p2p.start

    def counted(group: Any, send: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        sent[0] += sum(t.numel() for t in send)
        return start(group, send, *args, **kwargs)

    route = None
    if routed:
        assert rows is not None
        found = reach(rows, group)
        assert found.layout == layout == "contiguous", found
        route = found.route
    if method == "ring":
        with mock.patch.object(p2p, "start", counted):
            out = ring_attention(*parts, group=group, causal=causal, layout=layout, mask=rows, route=route)
            out.backward(grad)
        got = [out.detach(), *(p.grad for p in parts)]
        _, lse = ring_forward(
            *(p.detach() for p in parts), RingCall(group, causal=causal, layout=layout, mask=rows, route=route)
        )
    else:
        held = [p.detach() for p in parts]
        with mock.patch.object(p2p, "start", counted):
            ring = RingCall(group, causal, None, layout, rows, route)
            out, lse = tokenring_forward(*held, ring)
            got = [out, *tokenring_backward(grad, *held, out, lse, ring)]
    whole = []
    for x in got:
        assert x is not None
        pieces = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        whole.append(sequence_unshard(pieces, 2, layout))
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=mask, is_causal=causal, enable_gqa=kvh != heads)
    want.backward(dout)
    expected = [want.detach(), *(t.grad for t in ref)]
    names = ("out", "dq", "dk", "dv")
    errs = {n: float((a - b).abs().max()) for n, a, b in zip(names, whole, expected, strict=True)}
    # NOTE: the log-sum-exp the forward returns (what the backward op reads) is the whole sequence's
    pieces = [torch.empty_like(lse) for _ in range(cp)]
    dist.all_gather(pieces, lse.contiguous(), group=group)
    reps = heads // kvh
    full_k, full_v = k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1)
    _, want_lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, full_k, full_v, 0.0, causal, attn_mask=mask
    )
    errs["lse"] = float((sequence_unshard(pieces, 2, layout) - want_lse).abs().max())
    # NOTE: whole blocks to every rank: ring attention's keys and values forward and backward, their
    # gradients backward; TokenRing's queries and mask rows out and output and log-sum-exp back forward,
    # and backward the output's gradient, queries, output, log-sum-exp and mask rows out, query gradients back
    mask_rows = 0 if rows is None else rows.numel()
    if method == "ring":
        whole_blocks = 3 * (cp - 1) * (parts[1].numel() + parts[2].numel())
    else:
        whole_blocks = (cp - 1) * (6 * parts[0].numel() + 2 * lse.numel() + 2 * mask_rows)
    return errs | {"sent": sent[0], "whole": whole_blocks, "route": route, "rank": me}


def compiled_attention(
    model: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    plan: str,
    cp: str | None,
    tokens: tuple[int, int] | None,
    double: bool = False,
    moe: dict[str, Any] | None = None,
    pipeline: str | None = None,
) -> dict[str, Any]:
    """``cases.equivalence`` under ``cp={"method": cp}`` (and ``moe``; loss, every gradient and the
    parameters after AdamW steps equal single device), and how each forward attention of the
    compiled program reads its queries on each mesh axis: ``sequence`` (ring attention), ``heads``,
    ``batch`` or ``whole``; and, per running sum (``cumsum``), the dim it scans and its operand's
    placement on ``cp``; per phase, the ring steps and ``comm.ppermute`` ops (``passes/cp/steps.py``)."""
    from meshfold.ir.dialects.ring import RING_STEP, RING_STEP_BACKWARD, first_step
    from meshfold.ir.ops import PPERMUTE
    from meshfold.passes.sharding.rules.attention import RESULT_ROLES
    from meshfold.tools.zoo import build
    from tests.dist.cases import equivalence, token_inputs

    out = equivalence(
        model, shape, names, plan, tokens=tokens, cp=cp, double=double, moe=moe, keep_module=True, pipeline=pipeline
    )
    pm = out.pop("module")
    graph = pm.graph()
    # NOTE: which modules send point to point (through p2p.py or not) in one more step: ring.py (ring
    # attention), tokenring.py (TokenRing), ring_lowering.py (the move to the zigzag layout)
    senders: set[str] = set()
    send = dist.batch_isend_irecv

    def recorded(ops: list[Any]) -> list[Any]:
        frame = sys._getframe(1)
        while frame.f_back is not None and os.path.basename(frame.f_code.co_filename) == "p2p.py":
            frame = frame.f_back  # NOTE: the module that asked for the exchange
        senders.add(os.path.basename(frame.f_code.co_filename))
        return send(ops)

    with mock.patch.object(dist, "batch_isend_irecv", recorded):
        ids = token_inputs(tokens) if tokens is not None else build(model)[1]
        pm(*ids).backward()
    out["senders"] = sorted(senders)
    splits = []
    for op in graph.ops:
        if (op.target in RESULT_ROLES or first_step(op)) and op.prov.phase == "fwd":
            q = op.operands[0]
            rank = q.type.rank
            kinds = {rank - 2: "sequence", 1: "heads", 0: "batch"}
            splits.append({a: kinds.get(getattr(q.layout.placement(a), "dim", -1), "whole") for a in graph.mesh.names})
    out["attention"] = splits
    out["ring_steps"] = {
        phase: (
            sum(op.target in (RING_STEP, RING_STEP_BACKWARD) for op in ops),
            sum(op.target == PPERMUTE for op in ops),
        )
        for phase in ("fwd", "bwd")
        for ops in [[op for op in graph.ops if op.prov.phase == phase]]
    }
    out["scans"] = [
        (op.prov.phase, op.args[1], str(op.operands[0].layout.placement("cp")))
        for op in graph.ops
        if op.name == "aten.cumsum"
    ]
    out["recurrences"] = [
        (op.prov.phase, {a: str(op.operands[0].layout.placement(a)) for a in graph.mesh.names})
        for op in graph.ops
        if op.name.startswith("meshfold.affine_scan")
    ]
    out["convolutions"] = [
        (
            op.prov.phase,
            {a: str(op.operands[int(op.prov.phase == "bwd")].layout.placement(a)) for a in graph.mesh.names},
        )
        for op in graph.ops
        if op.name.startswith("meshfold.causal_conv1d")
    ]
    return out


def packed_sequences(world_cp: int, split_above: int | None) -> tuple[Any, Any]:
    """``hf-llama-packed``'s example sequences packed for ``world_cp`` ranks (``split_above`` as
    ``pack_sequences`` takes it) and in order for one device."""
    from meshfold.packing import pack_sequences
    from meshfold.tools.zoo.hf_zoo import PACKED_LENGTHS, PACKED_TOKENS

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 256, (n,), generator=g) for n in PACKED_LENGTHS]
    packed = pack_sequences(seqs, ranks=world_cp, tokens=PACKED_TOKENS, split_above=split_above)
    return packed, pack_sequences(seqs, ranks=1, tokens=PACKED_TOKENS)


def packed_attention(
    shape: tuple[int, ...], names: tuple[str, ...], plan: str, split_above: int | None, method: str = "ring"
) -> dict[str, Any]:
    """``hf-llama-packed`` (float64) compiled under ``cp={"method": method}`` on its sequences packed
    for the ``cp`` axis (each given a degree by ``split_above``), trained beside one device on the
    same sequences in order (``cases.equivalence``: loss, every gradient and the parameters after
    AdamW steps equal); then, in one more step, the elements of keys and values each rank's ring
    attention sends (TokenRing: of queries and what travels with them; every layer, forward and
    backward), how many times it gathered where the mask reaches, the packing's degrees and its
    ring tokens."""
    from tests.dist.cases import equivalence

    cp = shape[names.index("cp")]
    packed, natural = packed_sequences(cp, split_above)
    out = equivalence(
        "hf-llama-packed",
        shape,
        names,
        plan,
        cp=method,
        double=True,
        keep_module=True,
        inputs=packed.inputs(),
        ref_inputs=natural.inputs(),
    )
    pm = out.pop("module")
    sent = [0]
    start = p2p.start

    def counted(group: Any, send: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        # NOTE: ring attention's keys and values (not their gradients); TokenRing's queries out
        if sys._getframe(1).f_code.co_name in ("_around", "_steps"):
            sent[0] += sum(t.numel() for t in send)
        return start(group, send, *args, **kwargs)

    from meshfold.backends.context_parallel import ring_lowering

    reaches = [0]
    measured = ring_lowering.reach

    def reach_counted(*args: Any) -> Any:
        reaches[0] += 1
        return measured(*args)

    with mock.patch.object(p2p, "start", counted), mock.patch.object(ring_lowering, "reach", reach_counted):
        pm(*packed.inputs()).backward()
    out |= {"sent": sent[0], "degrees": packed.degrees, "ring_tokens": packed.ring_tokens(), "reaches": reaches[0]}
    return out


def zigzag_moves(seq: int, dim: int) -> bool:
    """Each rank's contiguous part of a tensor moved to the zigzag layout is ``sequence_shard``'s
    zigzag part, and moved back is the contiguous part again."""
    from meshfold.backends.context_parallel.ring_lowering import from_zigzag, to_zigzag

    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.arange(3 * seq * 2, dtype=torch.float64).reshape(3, seq, 2).movedim(1, dim)
    mine = sequence_shard(x, dim, world, rank, "contiguous")
    there = to_zigzag(mine, dist.group.WORLD, dim)  # type: ignore[arg-type]
    assert torch.equal(there, sequence_shard(x, dim, world, rank, "zigzag")), (rank, there)
    assert torch.equal(from_zigzag(there, dist.group.WORLD, dim), mine)  # type: ignore[arg-type]
    return True


def split_scans(seq: int) -> bool:
    """A running sum and flips along a dim split over the world (``backends/context_parallel/split_scans.py``)
    equal the whole
    tensor's, on each rank's part, in float64 and bool; and each traces with fake tensors (as Inductor
    traces a rank's program) to ATen ops and functional collectives only, the traced graph giving
    the same parts."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from meshfold.backends.context_parallel.split_scans import cumsum_split, flip_split

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    assert group is not None
    name = group.group_name
    x = torch.randn(2, seq, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mine = sequence_shard(x, 1, world, rank, "contiguous")
    summed = sequence_shard(x.cumsum(1), 1, world, rank, "contiguous")
    torch.testing.assert_close(cumsum_split(name, mine, 1), summed, rtol=1e-12, atol=1e-12)
    for dims in ([1], [0, 1], [2, 1]):
        for t, whole in ((mine, x), (mine > 0, x > 0)):
            flipped = flip_split((name,), t, dims)
            assert torch.equal(flipped, sequence_shard(whole.flip(dims), 1, world, rank, "contiguous")), dims
    traced = [
        (make_fx(lambda t: cumsum_split(name, t, 1), tracing_mode="fake")(mine), summed),
        (
            make_fx(lambda t: flip_split((name,), t, [1]), tracing_mode="fake")(mine),
            sequence_shard(x.flip([1]), 1, world, rank, "contiguous"),
        ),
    ]
    for graph, want in traced:
        targets = {n.target for n in graph.graph.nodes if n.op == "call_function"}
        assert all(isinstance(t, torch._ops.OpOverload) or t is operator.getitem for t in targets), targets
        assert any(getattr(t, "namespace", "") == "_c10d_functional" for t in targets), targets
        torch.testing.assert_close(graph(mine), want, rtol=1e-12, atol=1e-12)
    return True


def split_recurrence(steps: int, diagonal: bool) -> dict[str, float]:
    """``meshfold.affine_scan`` of ``steps`` steps (drawn alike on every rank, float64; ``diagonal``:
    element by element) with the steps split over the world in rank order (``affine_scan_split`` and
    its backward): the largest differences of this rank's states and gradients from the whole scan's
    on one device, ``ds0`` summed over the ranks."""
    from meshfold.backends.context_parallel.split_scans import affine_scan_backward_split, affine_scan_split
    from meshfold.ir.dialects.scan import affine_scan_backward, scan

    g = torch.Generator().manual_seed(0)
    m = 0.5 * torch.randn(2, 3, steps, 4, 5 if diagonal else 4, generator=g, dtype=torch.float64)
    b = torch.randn(2, 3, steps, 4, 5, generator=g, dtype=torch.float64)
    s0 = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64)
    grad = torch.randn(2, 3, steps, 4, 5, generator=g, dtype=torch.float64)
    h = scan(m, b, s0, diagonal)
    dm, db, ds0 = affine_scan_backward(m, h, grad, diagonal)
    n, r = dist.get_world_size(), dist.get_rank()
    part = slice(r * steps // n, (r + 1) * steps // n)
    group = dist.group.WORLD.group_name
    mine = affine_scan_split(group, m[:, :, part], b[:, :, part], s0, diagonal)
    dm_r, db_r, ds0_r = affine_scan_backward_split(group, m[:, :, part], mine, grad[:, :, part], diagonal)
    dist.all_reduce(ds0_r)
    return {
        "h": (mine - h[:, :, part]).abs().max().item(),
        "dm": (dm_r - dm[:, :, part]).abs().max().item(),
        "db": (db_r - db[:, :, part]).abs().max().item(),
        "ds0": (ds0_r - ds0).abs().max().item(),
        "scale": h.abs().max().item(),
    }


def split_conv(length: int) -> dict[str, float]:
    """``meshfold.causal_conv1d`` (filters of 4) with the sequence of ``length`` split over the world in
    rank order (``causal_conv1d_split`` and its backward): the largest differences of this rank's
    output and input gradient from one device's, and of ``dw``, ``dbias`` summed over the ranks."""
    from meshfold.backends.context_parallel.halo import causal_conv1d_backward_split, causal_conv1d_split
    from meshfold.ir.dialects.conv import causal_conv1d_backward, conv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, length, generator=g, dtype=torch.float64)
    w = torch.randn(3, 1, 4, generator=g, dtype=torch.float64)
    bias = torch.randn(3, generator=g, dtype=torch.float64)
    grad = torch.randn(2, 3, length, generator=g, dtype=torch.float64)
    y = conv(x, w, bias, x.new_zeros(2, 3, 3))
    dx, dw, db = causal_conv1d_backward(grad, x, w)
    n, r = dist.get_world_size(), dist.get_rank()
    part = slice(r * length // n, (r + 1) * length // n)
    group = dist.group.WORLD.group_name
    mine = causal_conv1d_split(group, x[..., part], w, bias)
    dx_r, dw_r, db_r = causal_conv1d_backward_split(group, grad[..., part], x[..., part], w)
    dist.all_reduce(dw_r)
    dist.all_reduce(db_r)
    return {
        "y": (mine - y[..., part]).abs().max().item(),
        "dx": (dx_r - dx[..., part]).abs().max().item(),
        "dw": (dw_r - dw).abs().max().item(),
        "db": (db_r - db).abs().max().item(),
    }
