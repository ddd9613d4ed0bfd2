"""``LOWERINGS``: which ops lower how, in one place (``LoweringTable.lookup`` gives the order).

=================================================  ===========================================
ops                                                lowering
=================================================  ===========================================
every op that draws (``backends/random.py``)       kind, checked first: a ``RandomSite`` that
                                                   draws this rank's part of the one-device
                                                   values from meshfold's generator
``mem.offload``, ``mem.reload``                    the host tier (``backends/host_tier.py``)
running sums, flips, linear recurrences, causal    the split form across the group of the mesh
convolutions (``_split_scan``)                     axes splitting their dim, else local
the CPU flash attention kernels                    ring attention / TokenRing when the sequence
                                                   is split (``_ring_call``), else local
``meshfold.ring_step`` and its backward            local, with this rank's coordinate on the
                                                   ring's axis in place of the IR's -1
``meshfold.moe_experts`` and its backward          the token exchange between expert ranks
                                                   (``_exchange_call``), else local (ranged)
our other ops (``lse_merge``, ``constant``, the    local: they run unchanged on their shards
pipeline stage marks)
every other ``OpDef`` (``comm.*``)                 kind: the functional collective
                                                   (``backends/collectives.py``), waited at once
anything else (ATen)                               the default: local (``_local``)
=================================================  ===========================================

"Local" is the op called on this rank's tensors, with its shape-spelling arguments localized and,
for a ranged op whose indexed dim is sharded, its ranged implementation (``backends/local.py``).
``backends/eager.py`` builds each rank's modules by calling ``LOWERINGS.lower`` op by op; a
collective a ``comm.wait`` reads is issued through :func:`issue_op` there instead, and waited at
the wait.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from meshfold import ir
from meshfold.backends.collectives import Issued, issue, local_shapes
from meshfold.backends.context_parallel.halo import causal_conv1d_backward_split, causal_conv1d_split
from meshfold.backends.context_parallel.ring_lowering import KERNELS as RING_KERNELS
from meshfold.backends.context_parallel.ring_lowering import kernel_backward as ring_kernel_backward
from meshfold.backends.context_parallel.split_scans import (
    affine_scan_backward_split,
    affine_scan_split,
    cumsum_split,
    flip_split,
)
from meshfold.backends.experts.dispatch import Peers, exchange_backward, exchange_forward
from meshfold.backends.host_tier import offload, reload, reload_start, reload_wait
from meshfold.backends.interpret import runnable_target
from meshfold.backends.lowering.emit import EmitContext, LoweringTable, RankContext
from meshfold.backends.random import is_random, random_site
from meshfold.ir import Op, OpDef, TensorType
from meshfold.ir.dialects.constant import CONSTANT
from meshfold.ir.dialects.conv import CONV, CONV_BACKWARD
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD, TOKENS_AND_WEIGHTS
from meshfold.ir.dialects.moe import exchange_axes as exchange_axes_of
from meshfold.ir.dialects.ring import LSE_MERGE, RANK_ARG
from meshfold.ir.dialects.scan import SCAN, SCAN_BACKWARD
from meshfold.ir.dialects.stage import MARKS
from meshfold.ir.ops import OFFLOAD, RELOAD
from meshfold.passes.sharding.rules.operands import int_arg, norm_dim, op_arg

aten = torch.ops.aten

LOWERINGS = LoweringTable("lowerings")


@LOWERINGS.kind("random", is_random, first=True)
def _random(ctx: EmitContext, op: Op) -> list[fx.Node]:
    site = random_site(op, ctx.rng, ctx.rank.mesh, ctx.rank.coordinate)
    return ctx.call(op, site, op.args, dict(op.kwargs))


_TIERS = {OFFLOAD: offload, RELOAD: reload}
"""``mem.*``: an activation to the host tier and back (``backends/host_tier.py``)."""


@LOWERINGS.op(OFFLOAD, RELOAD)
def _host_tier(ctx: EmitContext, op: Op) -> list[fx.Node]:
    return [ctx.graph.call_function(_TIERS[op.target], (ctx.env[op.operands[0]],))]


@LOWERINGS.fallback
@LOWERINGS.op(LSE_MERGE, CONSTANT, *MARKS)
def _local(ctx: EmitContext, op: Op) -> list[fx.Node]:
    """``op`` on this rank's tensors: its ranged implementation on the slice this rank holds when
    it is ranged and that dim is sharded, else the op itself (``backends/local.py``)."""
    args, kwargs = ctx.local_args(op)
    rank = ctx.rank
    bounds = ctx.local.slice_of(op, rank.mesh, rank.coordinate)
    if bounds is not None:
        return ctx.call(op, ctx.local.ranged[op.target].impl, args, kwargs, head=bounds)
    return ctx.call(op, runnable_target(op.target), args, kwargs)


@LOWERINGS.op(SCAN, SCAN_BACKWARD, CONV, CONV_BACKWARD, aten.cumsum.default, aten.flip.default)
def _along_a_split_dim(ctx: EmitContext, op: Op) -> list[fx.Node]:
    return _across_ranks(ctx, op, _split_scan(op, ctx.rank))


@LOWERINGS.op(*RING_KERNELS)
def _attention_kernel(ctx: EmitContext, op: Op) -> list[fx.Node]:
    return _across_ranks(ctx, op, _ring_call(op, ctx.rank))


def _across_ranks(ctx: EmitContext, op: Op, own: tuple[Any, tuple[Any, ...]] | None) -> list[fx.Node]:
    """An op that communicates itself along a split dim: ``own``, its function and the leading
    arguments that say across which ranks; None (the dim is whole): the op as it is (``_local``)."""
    if own is None:
        return _local(ctx, op)
    fn, head = own
    args, kwargs = ctx.local_args(op)
    return ctx.call(op, fn, args, kwargs, head=head)


@LOWERINGS.op(*RANK_ARG)
def _ring_step(ctx: EmitContext, op: Op) -> list[fx.Node]:
    args, kwargs = ctx.local_args(op)
    return ctx.call(op, runnable_target(op.target), _ranked(op, args, ctx.rank), kwargs)


EXCHANGES = {EXPERTS: exchange_forward, EXPERTS_BACKWARD: exchange_backward}
"""The ops that exchange tokens themselves (their operands: ``ir.dialects.moe.TOKENS_AND_WEIGHTS``)."""


@LOWERINGS.op(*EXCHANGES)
def _routed_experts(ctx: EmitContext, op: Op) -> list[fx.Node]:
    peers = _exchange_peers(op, ctx.rank)
    if peers is None:
        return _local(ctx, op)
    args, kwargs = ctx.local_args(op)
    return ctx.call(op, EXCHANGES[op.target], args, kwargs, head=(peers,))


@LOWERINGS.kind("comm", lambda op: isinstance(op.target, OpDef))
def _collective(ctx: EmitContext, op: Op) -> list[fx.Node]:
    return issue_op(ctx, op).complete(ctx.graph)


def issue_op(ctx: EmitContext, op: Op) -> Issued:
    """Start ``op``'s collective (or a reload's copy); its result comes at ``Issued.complete``."""
    g, rank = ctx.graph, ctx.rank
    if op.target == RELOAD:  # NOTE: the copy issued here, waited for at its comm.wait
        return Issued(g.call_function(reload_start, (ctx.env[op.operands[0]],)), lambda g, out: [out], wait=reload_wait)
    axis = str(op.kwarg("axis"))
    xs = [ctx.env[x] for x in op.operands]
    local = local_shapes(op, rank.mesh)
    return issue(g, op, xs, rank.size(axis), rank.group(axis), rank.coord(axis), local, gloo=rank.gloo)


_SPLIT: dict[Any, Any] = {
    SCAN: affine_scan_split,
    SCAN_BACKWARD: affine_scan_backward_split,
    CONV: causal_conv1d_split,
    CONV_BACKWARD: causal_conv1d_backward_split,
}


def along_split(op: Op, names: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes (in mesh order) that split the dim a running sum, linear recurrence or causal
    convolution runs along (which it then runs across itself); empty for any other op."""
    if op.target in _SPLIT:
        x = op.operands[1 if op.target == CONV_BACKWARD else 0]
        assert isinstance(x.type, TensorType)
        dim = x.type.rank - 3 if op.target in (SCAN, SCAN_BACKWARD) else 2
    elif op.target == aten.cumsum.default:
        x = op.operands[0]
        assert isinstance(x.type, TensorType)
        dim = norm_dim(int_arg(op, "dim", 0), x.type.rank)
    else:
        return ()
    return tuple(a for a in names if x.layout.placement(a) == ir.Shard(dim))


def _split_scan(op: Op, rank: RankContext) -> tuple[Any, tuple[Any, ...]] | None:
    """A running sum, flip, linear recurrence or causal convolution along a dim split over mesh axes:
    its function and the process group it runs across (a dim split over several axes: the group over
    all of them, whose ranks hold its pieces in order), or the flip's per-axis groups; None for any
    other op, and for those along whole dims."""
    axes = along_split(op, rank.mesh.names)
    if axes and op.target in (CONV, CONV_BACKWARD):
        x, w = op.operands[1:3] if op.target == CONV_BACKWARD else op.operands[:2]
        assert isinstance(x.type, TensorType) and isinstance(w.type, TensorType)
        part, reach = x.layout.local_shape(x.type.shape, rank.mesh)[2], int(w.type.shape[-1]) - 1
        if isinstance(part, int) and part < reach:
            raise ValueError(
                f"{op.describe()}: each rank holds {part} positions of the sequence, fewer than the convolution "
                f"reaches back ({reach}); use fewer ranks on {' x '.join(axes)} or a longer sequence"
            )
    if axes:
        fn = cumsum_split if op.target == aten.cumsum.default else _SPLIT[op.target]
        return fn, (rank.group_over(axes),)
    if op.target != aten.flip.default:
        return None
    x = op.operands[0]
    assert isinstance(x.type, TensorType)
    dims = op_arg(op, "dims")
    assert isinstance(dims, (list, tuple))
    along = {norm_dim(int(d), x.type.rank) for d in dims}
    flipped = [a for a in rank.mesh.names if isinstance(p := x.layout.placement(a), ir.Shard) and p.dim in along]
    return (flip_split, (tuple(rank.group(a) for a in flipped),)) if flipped else None


def _ring_call(op: Op, rank: RankContext) -> tuple[Any, tuple[Any, ...]] | None:
    """An attention kernel run as ring attention (or TokenRing) over the process group of the mesh
    axis its queries are split along their sequence on (``rules.attention.ring_strategy``): the
    kernel and its leading arguments (the group and the method); None when the sequence is whole."""
    q = op.operands[1 if RING_KERNELS[op.target] is ring_kernel_backward else 0]  # NOTE: after grad_out
    assert isinstance(q.type, TensorType)
    seq = ir.Shard(q.type.rank - 2)
    axes = [a for a in rank.mesh.names if q.layout.placement(a) == seq]
    assert len(axes) <= 1, f"{op.describe()}: a sequence split over several mesh axes has no ring"
    return (RING_KERNELS[op.target], (rank.group(axes[0]), rank.cp_method)) if axes else None


def _ranked(op: Op, args: tuple[Any, ...], rank: RankContext) -> tuple[Any, ...]:
    """A ring step's arguments with this rank's coordinate on the axis its queries' sequence is split
    over (``ir.dialects.ring``: the IR holds -1 there, every rank's part)."""
    x = op.operands[0]  # NOTE: every tensor of a ring step is held alike (``rules.attention``)
    axes = [a for a in rank.mesh.names if x.layout.placement(a) == ir.Shard(2)]
    assert len(axes) == 1, f"{op.describe()}: a ring step's sequence is split over one mesh axis"
    at = RANK_ARG[op.target]
    return (*args[:at], rank.coord(axes[0]), *args[at + 1 :])


def _exchange_peers(op: Op, rank: RankContext) -> Peers | None:
    """Who the all-to-all dispatcher exchanges ``op``'s tokens with; None when no axis splits them."""
    axes = tuple(a for a in rank.mesh.names if a in exchange_axes_of(op))
    if not axes:
        return None
    _, weights = TOKENS_AND_WEIGHTS[op.target]
    w = op.operands[weights]
    assert isinstance(w.type, TensorType)
    coords = [rank.coordinate]
    for a in axes:  # NOTE: peers in row-major order over the exchange axes
        i = rank.mesh.index(a)
        coords = [(*c[:i], j, *c[i + 1 :]) for c in coords for j in range(rank.size(a))]
    # NOTE: the first expert each peer holds: its offset on the expert weight's dim 0
    los = tuple(w.layout.shard_bounds(w.type.shape, rank.mesh, c)[0][0] for c in coords)
    size = w.layout.local_shape(w.type.shape, rank.mesh)[0]
    if op.args[-1] == "hierarchical" and len(axes) > 1:
        # NOTE: one hop per axis, innermost first; an axis's digit in the row-major slot has this stride
        strides = [math.prod(rank.size(b) for b in axes[i + 1 :]) for i in range(len(axes))]
        hops = tuple((rank.group(a), rank.size(a), st) for a, st in reversed(list(zip(axes, strides, strict=True))))
    else:
        hops = ((rank.group_over(axes), len(coords), 1),)
    return Peers(hops, coords.index(rank.coordinate), los, size)
