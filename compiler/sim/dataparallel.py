"""Data-parallel traffic of a step: gradient reduction and parameter gathering under each ZeRO stage.

Reduce-scatter (or all-reduce) of gradients starts bucket by bucket during the last micro-batch's
backward (ZeRO-2's during every micro-batch's, each running on while the next micro-batch
computes), the parameter all-gather of the distributed optimizer during the first micro-batch's
forward; rank ``r`` of the pipeline finishes its last backward (starts its first forward) ``r``
chunk-passes before (after) rank 0, which hides that much more of its own traffic. FSDP gathers
(twice) and reduces every micro-batch, layer by layer. On a cluster of node groups with different
NICs each rank's groups run at the NICs of the nodes they touch (``comm.instance_view``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshfold.passes.cost import comm
from meshfold.passes.cost.comm import Group
from meshfold.sim.footprint import BUCKET_MIN, StageLayers, stage_params
from meshfold.sim.model import ModelSpec
from meshfold.sim.parallel import ParallelConfig, TrainSpec
from meshfold.sim.stagesplit import PipelineStages
from meshfold.target.hardware import Cluster


def _hide(c: float, window: float, buckets: float, overlap: bool) -> float:
    """Exposed part of ``c`` seconds of bucketed traffic overlapped with ``window`` of compute:
    bucket i is ready at i/n of the window, the stream drains them in order."""
    if c <= 0:
        return 0.0
    if not overlap:
        return c
    n = max(1.0, buckets)
    return max(c / n, c + window / n - window)


def reduce_tail(red: float, bwd_chunk: float, pp: int, vpp: int, buckets: float, overlap: bool) -> float:
    """Exposed gradient reduction after stage 0's last backward. Model chunk ``c`` finishes its
    last backward ``c * pp`` chunk-passes before the end (interleaved cool-down order), so its
    buckets reduce while the remaining chunks compute; chunk 0's last buckets are always exposed."""
    if red <= 0:
        return 0.0
    if not overlap:
        return red
    per, n = red / vpp, max(1.0, buckets)
    finish = -math.inf
    for c in range(vpp - 1, -1, -1):
        end = -c * pp * bwd_chunk
        finish = max(finish + per, end - bwd_chunk + bwd_chunk / n + per, end + per / n)
    return max(0.0, finish)


def lagging_reduce(red: float, bwd: float, slot: float, m: int, buckets: float, overlap: bool) -> float:
    """Exposed seconds of ZeRO-2's gradient reduce-scatter, ``red`` seconds after each of ``m``
    micro-batches' backward (``bwd`` seconds), micro-batches ``slot`` seconds apart. The reduction
    runs on its own stream while compute goes on with the next micro-batch, so only the last one
    must end before the optimizer: it shows what its buckets leave beyond the last backward, plus
    the backlog when reductions take longer than a slot (``(m - 1) (red - slot)``)."""
    if red <= 0:
        return 0.0
    if not overlap:
        return m * red
    return max(0.0, (m - 1) * (red - slot)) + _hide(red, bwd, buckets, overlap)


def gather_head(gat: float, fwd_chunk: float, pp: int, vpp: int, buckets: float, overlap: bool) -> float:
    """Delay of stage 0's first forward waiting for parameter all-gathers: chunk ``c`` is first
    needed ``c * pp`` chunk-passes into the warm-up, bucket by bucket during that forward."""
    if gat <= 0:
        return 0.0
    if not overlap:
        return gat
    per, n = gat / vpp, max(1.0, buckets)
    delay, done = 0.0, 0.0
    for c in range(vpp):
        need = c * pp * fwd_chunk
        delay = max(delay, done + per / n - need, done + per - need - (n - 1) / n * fwd_chunk)
        done += per
    return delay


def _dp_comm(
    cluster: Cluster, cfg: ParallelConfig, train: TrainSpec, rank: int, dense: float, expert: float
) -> tuple[float, float]:
    """(gradient reduction, parameter gather) seconds for pipeline rank ``rank``'s parameters: dense
    ones over dp x cp, expert ones over the expert data-parallel group only, each at the NICs of
    the nodes its instance for that rank touches."""
    attn, exp_axes = cfg.attention_axes(), cfg.expert_axes()
    g, w = train.grad_bytes, train.weight_bytes
    at = (("pp", rank),)
    dnames, enames = ("cp", "dp"), cfg.edp_axes()
    dview, eview = comm.instance_view(cluster, attn, dnames, at), comm.instance_view(cluster, exp_axes, enames, at)
    dgroup: Group = comm.place_axes(cluster, attn, dnames)
    egroup: Group = comm.place_axes(cluster, exp_axes, enames)
    if cfg.zero == 0:
        red = comm.all_reduce(dview, dgroup, dense * g) + comm.all_reduce(eview, egroup, expert * g)
        return red, 0.0
    red = comm.reduce_scatter(dview, dgroup, dense * g) + comm.reduce_scatter(eview, egroup, expert * g)
    gat = comm.all_gather(dview, dgroup, dense * w) + comm.all_gather(eview, egroup, expert * w)
    return red, gat


@dataclass(frozen=True, slots=True)
class DataParallel:
    """Step-level data-parallel traffic: seconds of gathers and reductions, the parts the compute
    stream waits for (before the first forward, after the last backward), and all of it."""

    gather: float
    reduce: float
    fwd_exposed: float
    bwd_exposed: float
    total: float


def data_parallel(
    cluster: Cluster,
    model: ModelSpec,
    cfg: ParallelConfig,
    train: TrainSpec,
    m: int,
    stages: PipelineStages,
    passes: Sequence[tuple[float, float]],
    slow: tuple[float, float],
) -> DataParallel:
    """Gradient reduction and parameter gathering under the ZeRO stage of ``cfg``; the rank whose
    exposed part is largest sets it. A one-time gather (reduction) of rank ``r`` has ``r`` chunk
    passes of slack before (after) rank 0's first forward (last backward); traffic every
    micro-batch (ZeRO-2's reduction, FSDP) runs at the pace of the slowest rank. ``gather`` and
    ``reduce`` are rank 0's (the timeline's). ``passes`` are each rank's (forward, backward) seconds
    per micro-batch, ``slow`` the slowest rank's."""
    ov = cfg.dp_overlap
    worst_f = worst_b = total = 0.0
    gather0 = reduce0 = 0.0
    for layers, (fwd, bwd) in zip(stages.ranks, passes, strict=True):
        r = layers.rank
        sp = stage_params(model, cfg, layers)
        red, gat = _dp_comm(cluster, cfg, train, r, sp.dense, sp.expert)
        if r == 0:
            gather0, reduce0 = gat, red
        buckets = math.ceil(sp.total / max(BUCKET_MIN, 1e6 * cfg.dp))
        if cfg.zero <= 1:
            per_chunk = buckets / cfg.vpp
            f = gather_head(gat, fwd / cfg.vpp, cfg.pp, cfg.vpp, per_chunk, ov) - r * slow[0] / cfg.vpp
            b = reduce_tail(red, bwd / cfg.vpp, cfg.pp, cfg.vpp, per_chunk, ov) - r * slow[1] / cfg.vpp
            tot = red + gat
        elif cfg.zero == 2:
            f = _hide(gat, fwd, buckets, ov) - r * slow[0] / cfg.vpp
            b = lagging_reduce(red, bwd, slow[0] + slow[1], m, buckets, ov)
            tot = m * red + gat
        else:
            f = m * _hide(gat, fwd, layers.layers, ov)
            b = m * _hide(gat + red, bwd, layers.layers, ov)
            tot = m * (2 * gat + red)
        worst_f, worst_b, total = max(worst_f, f), max(worst_b, b), max(total, tot)
    return DataParallel(gather0, reduce0, worst_f, worst_b, total)


def fsdp_floor(
    cluster: Cluster, model: ModelSpec, cfg: ParallelConfig, train: TrainSpec, m: int, fwd: float, bwd: float
) -> float:
    """A lower bound of ``data_parallel``'s exposed seconds (forward and backward) under FSDP that
    needs no stage split (the search prunes with it); 0 under other ZeRO stages and on a cluster
    of node groups with different NICs. ``fwd`` and ``bwd`` are the seconds per micro-batch of all
    the pipeline ranks together.

    A rank's gathers hide at most behind its own pass (``_hide(c, w, n) >= c - w``) and the most
    exposed rank exposes at least the mean; over all ranks the dense gathers take ``pp`` times
    the mean rank's (a collective is affine in its bytes and every rank holds dense parameters),
    the expert ones at least one collective of all of them."""
    if cfg.zero != 3 or cluster.heterogeneous:
        return 0.0
    pp, w, g = cfg.pp, train.weight_bytes, train.grad_bytes
    whole = stage_params(model, cfg, StageLayers(0, model.dense_layers, model.moe_layers, True, True))
    dgroup = comm.place_axes(cluster, cfg.attention_axes(), ("cp", "dp"))
    egroup = comm.place_axes(cluster, cfg.expert_axes(), cfg.edp_axes())
    gat = pp * comm.all_gather(cluster, dgroup, whole.dense * w / pp) + comm.all_gather(
        cluster, egroup, whole.expert * w
    )
    red = pp * comm.reduce_scatter(cluster, dgroup, whole.dense * g / pp)
    red += comm.reduce_scatter(cluster, egroup, whole.expert * g)
    return m * (max(0.0, gat - fwd) + max(0.0, gat + red - bwd)) / pp
