"""Cluster simulator: one optimizer step of a transformer under a ParallelConfig, analytically.

The step of the slowest pipeline stage is ``m`` micro-batches of forward + backward (repeated
layers costed once, see ``layer``), plus the pipeline bubble ``(pp - 1) / vpp`` stage-passes (so
its share of the ideal time is ``(pp - 1) / (vpp m)``), plus whatever data-parallel traffic the
buckets cannot hide, plus the optimizer. Data-parallel reduce-scatter (or all-reduce) of
gradients starts bucket by bucket during the last micro-batch's backward, the parameter
all-gather of the distributed optimizer during the first micro-batch's forward; FSDP gathers
(twice) and reduces every micro-batch, layer by layer. The busiest expert rank and the slowest
stage set the pace. Everything is deterministic.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from meshfold.passes.cost import comm, opcost
from meshfold.passes.cost.comm import Group
from meshfold.passes.cost.edges import embedding_cost, head_cost
from meshfold.passes.cost.footprint import (
    BUCKET_MIN,
    StageParams,
    layer_activation_bytes,
    memory_breakdown,
    peak_memory,
    stage_params,
)
from meshfold.passes.cost.hardware import Cluster
from meshfold.passes.cost.layer import LayerPlan, layer_cost
from meshfold.passes.cost.model import ModelSpec
from meshfold.passes.cost.parallel import ConfigError, ParallelConfig, TrainSpec
from meshfold.passes.cost.result import SimResult
from meshfold.passes.cost.streams import LayerCost
from meshfold.passes.cost.timeline import StageSchedule, build_timeline
from meshfold.passes.cost.trace import plot_memory, to_chrome_trace

__all__ = ["ConfigError", "ParallelConfig", "SimResult", "TrainSpec", "plot_memory", "simulate", "to_chrome_trace"]


@dataclass(frozen=True, slots=True)
class _Stage:
    fwd: float
    bwd: float
    exposed: float

    @property
    def total(self) -> float:
        """Forward plus backward of one micro-batch on the stage."""
        return self.fwd + self.bwd


def layer_plan(cluster: Cluster, cfg: ParallelConfig) -> LayerPlan:
    """The per-layer view of ``cfg``: sizes and where its tp / cp / ep / etp groups sit."""
    attn, expert = cfg.attention_axes(), cfg.expert_axes()
    return LayerPlan(
        cfg.tp,
        cfg.cp,
        cfg.sp,
        cfg.micro_batch_size,
        cfg.recompute,
        cfg.tp_comm_overlap and cfg.tp > 1,
        cfg.ep,
        cfg.etp_size,
        comm.place_axes(cluster, attn, ("tp",)),
        comm.place_axes(cluster, attn, ("cp",)),
        comm.place_axes(cluster, expert, ("ep",)),
        comm.place_axes(cluster, expert, ("etp",)),
        cfg.cp_method,
    )


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
    cluster: Cluster, cfg: ParallelConfig, train: TrainSpec, dense: float, expert: float
) -> tuple[float, float]:
    """(gradient reduction, parameter gather) seconds for one stage's parameters: dense ones over
    dp x cp, expert ones over the expert data-parallel group only."""
    attn, exp_axes = cfg.attention_axes(), cfg.expert_axes()
    g, w = train.grad_bytes, train.weight_bytes
    dgroup: Group = comm.place_axes(cluster, attn, ("cp", "dp"))
    egroup: Group = comm.place_axes(cluster, exp_axes, cfg.edp_axes())
    if cfg.zero == 0:
        red = comm.all_reduce(cluster, dgroup, dense * g) + comm.all_reduce(cluster, egroup, expert * g)
        return red, 0.0
    red = comm.reduce_scatter(cluster, dgroup, dense * g) + comm.reduce_scatter(cluster, egroup, expert * g)
    gat = comm.all_gather(cluster, dgroup, dense * w) + comm.all_gather(cluster, egroup, expert * w)
    return red, gat


@dataclass(frozen=True, slots=True)
class _DataParallel:
    """Step-level data-parallel traffic: seconds of gathers and reductions, the parts the compute
    stream waits for (before the first forward, after the last backward), and all of it."""

    gather: float
    reduce: float
    fwd_exposed: float
    bwd_exposed: float
    total: float


def _data_parallel(
    cluster: Cluster, model: ModelSpec, cfg: ParallelConfig, train: TrainSpec, m: int, first: _Stage
) -> _DataParallel:
    """Gradient reduction and parameter gathering of stage 0 under the ZeRO stage of ``cfg``."""
    sp0 = stage_params(model, cfg, "first")
    red, gat = _dp_comm(cluster, cfg, train, sp0.dense, sp0.expert)
    buckets = math.ceil(sp0.total / max(BUCKET_MIN, 1e6 * cfg.dp))
    ov = cfg.dp_overlap
    if cfg.zero <= 1:
        per_chunk = buckets / cfg.vpp
        dp_f = gather_head(gat, first.fwd / cfg.vpp, cfg.pp, cfg.vpp, per_chunk, ov)
        dp_b = reduce_tail(red, first.bwd / cfg.vpp, cfg.pp, cfg.vpp, per_chunk, ov)
        return _DataParallel(gat, red, dp_f, dp_b, red + gat)
    if cfg.zero == 2:
        dp_f, dp_b = _hide(gat, first.fwd, buckets, ov), m * _hide(red, first.bwd, buckets, ov)
        return _DataParallel(gat, red, dp_f, dp_b, m * red + gat)
    layers_per_stage = model.layers / cfg.pp
    dp_f = m * _hide(gat, first.fwd, layers_per_stage, ov)
    dp_b = m * _hide(gat + red, first.bwd, layers_per_stage, ov)
    return _DataParallel(gat, red, dp_f, dp_b, m * (2 * gat + red))


def _optimizer_time(cluster: Cluster, cfg: ParallelConfig, train: TrainSpec, sp0: StageParams) -> float:
    """Seconds of the (memory-bound) optimizer update of stage 0's shard of the parameters."""
    g, w = train.grad_bytes, train.weight_bytes
    shard = (sp0.dense / (cfg.dp * cfg.cp) + sp0.expert / cfg.edp) if cfg.zero >= 1 else sp0.total
    state = (16 if train.optimizer == "adam" else 8) + (8 if w < 4 else 0)
    opt_bytes = shard * (2 * g + state + w) + (sp0.total if cfg.zero < 2 else shard) * g
    return opcost.memory_time(cluster.device, opt_bytes, kernels=4)


@dataclass(frozen=True, slots=True)
class _Pipeline:
    """The pipeline part of a step: its seconds, the bubble, and the stage-to-stage sends."""

    total: float
    bubble: float
    p2p_per_mb: float
    p2p_fill: float


def _pipeline(
    cluster: Cluster, model: ModelSpec, cfg: ParallelConfig, train: TrainSpec, m: int, slow: _Stage
) -> _Pipeline:
    """``m`` micro-batches of the slowest stage, the (pp - 1) / vpp bubble and activation sends."""
    tsp = cfg.micro_batch_size * train.seq_len / cfg.cp / (cfg.tp if cfg.sp else 1)
    pp_group = comm.place_axes(cluster, cfg.attention_axes(), ("pp",))
    nbytes = tsp * model.hidden * train.act_bytes
    p2p = comm.p2p(cluster, nbytes, cross_node=pp_group.spans_nodes) if cfg.pp > 1 else 0.0
    p2p_per_mb = 2 * p2p if cfg.vpp == 1 else 0.0  # NOTE: the interleaved schedule overlaps its sends
    p2p_fill = 2 * (cfg.pp - 1) * p2p
    bubble = (cfg.pp - 1) / cfg.vpp * slow.total
    return _Pipeline(m * (slow.total + p2p_per_mb) + bubble + p2p_fill, bubble, p2p_per_mb, p2p_fill)


@functools.lru_cache(maxsize=256)
def _flops_per_token(model: ModelSpec, seq_len: int, causal: bool) -> float:
    """Model FLOPs per trained token (cached: the search asks once per configuration)."""
    return model.flops_per_token(seq_len, causal=causal)


def _kinds(model: ModelSpec) -> tuple[tuple[str, int], ...]:
    """(layer kind, count) of the kinds ``model`` has."""
    return tuple((k, n) for k, n in (("dense", model.dense_layers), ("moe", model.moe_layers)) if n)


def _per_stage(model: ModelSpec, cfg: ParallelConfig, costs: dict[str, LayerCost], attr: str) -> float:
    """Sum of the LayerCost field ``attr`` over the layers of one pipeline stage (an even share)."""
    return float(sum(n / cfg.pp * getattr(costs[k], attr) for k, n in _kinds(model)))


def _stages(
    model: ModelSpec, cfg: ParallelConfig, costs: dict[str, LayerCost], emb: LayerCost, head: LayerCost
) -> tuple[_Stage, _Stage]:
    """(first stage, slowest stage) per micro-batch: the layers of a stage plus its edges."""

    def body(attr: str) -> float:
        return _per_stage(model, cfg, costs, attr)

    bf, bb, bx = body("fwd_s"), body("bwd_s"), body("fwd_exposed_s") + body("bwd_exposed_s")

    def stage(edges: tuple[LayerCost, ...]) -> _Stage:
        return _Stage(
            bf + sum(e.fwd_s for e in edges),
            bb + sum(e.bwd_s for e in edges),
            bx + sum(e.fwd_exposed_s + e.bwd_exposed_s for e in edges),
        )

    if cfg.pp == 1:
        first = stage((emb, head))
        return first, first
    stages = [stage((emb,)), stage((head,))] + ([stage(())] if cfg.pp > 2 else [])
    return stages[0], max(stages, key=lambda s: s.total)


@dataclass(frozen=True, slots=True)
class _Costed:
    """The costed micro-batch of a configuration: layer and edge costs, stages, pipeline."""

    plan: LayerPlan
    costs: dict[str, LayerCost]
    emb: LayerCost
    head: LayerCost
    first: _Stage
    slow: _Stage
    pipe: _Pipeline


def _costed(model: ModelSpec, cluster: Cluster, cfg: ParallelConfig, train: TrainSpec) -> _Costed:
    """Cost the layers, edges, stages and pipeline of a validated ``cfg`` (cached; the ZeRO stage
    and data-parallel overlap do not change them, so configurations that differ only there share)."""
    return _costed_cached(model, cluster, replace(cfg, zero=1, dp_overlap=True), train)


@functools.lru_cache(maxsize=1024)
def _costed_cached(model: ModelSpec, cluster: Cluster, cfg: ParallelConfig, train: TrainSpec) -> _Costed:
    """``_costed`` on a configuration whose data-parallel fields are normalised."""
    plan = layer_plan(cluster, cfg)
    args = (model, cluster, train.dtype, train.grad_dtype, train.causal, train.flash_attention, train.seq_len, plan)
    costs = {k: layer_cost(*args, k) for k, _ in _kinds(model)}
    edge_plan = replace(plan.dense_view(), recompute="none")  # NOTE: edges never recompute
    emb = embedding_cost(model, cluster, train.dtype, train.grad_dtype, train.seq_len, edge_plan)
    head = head_cost(model, cluster, train.dtype, train.grad_dtype, train.seq_len, edge_plan)
    first, slow = _stages(model, cfg, costs, emb, head)
    pipe = _pipeline(cluster, model, cfg, train, cfg.num_microbatches(train), slow)
    return _Costed(plan, costs, emb, head, first, slow, pipe)


def pipeline_time(model: ModelSpec, cluster: Cluster, config: ParallelConfig, train: TrainSpec) -> float:
    """Seconds of the pipeline part of a step of a valid ``config`` (micro-batches of the slowest
    stage, bubble, stage-to-stage sends). Every other part of ``simulate``'s step time is
    non-negative, so this is a lower bound of it (the search prunes with it)."""
    return _costed(model, cluster, config, train).pipe.total


def simulate(
    model: ModelSpec, cluster: Cluster, config: ParallelConfig, train: TrainSpec, *, timeline: bool = True
) -> SimResult:
    """Simulate one optimizer step of ``model`` on ``cluster`` under ``config``.

    Raises ConfigError naming the violated constraint when ``config`` cannot run. ``timeline``
    False skips the per-event timeline and memory timeline (the search uses that; every figure
    is identical either way)."""
    config.validate(model, cluster, train)
    dev, cfg = cluster.device, config
    m = cfg.num_microbatches(train)
    c = _costed(model, cluster, cfg, train)
    costs, emb, head, first, slow, pipe = c.costs, c.emb, c.head, c.first, c.slow, c.pipe
    dp = _data_parallel(cluster, model, cfg, train, m, first)
    dp_exposed = dp.fwd_exposed + dp.bwd_exposed
    dp_contention = dev.eff.contention * (dp.total - dp_exposed)
    tied = 0.0
    if model.tied_embeddings and cfg.pp > 1:
        tied = comm.all_reduce(cluster, comm.Group(2, 1, 2), model.vocab * model.hidden / cfg.tp * train.grad_bytes)
    optimizer = _optimizer_time(cluster, cfg, train, stage_params(model, cfg, "first"))

    step = pipe.total + dp_exposed + dp_contention + tied + optimizer
    flops = _flops_per_token(model, train.seq_len, train.mfu_causal) * train.tokens
    world = cluster.world_size
    layer_exposed = m * slow.exposed
    compute = m * slow.total - layer_exposed
    p2p_exposed = m * pipe.p2p_per_mb + pipe.p2p_fill
    mem = peak_memory(model, cluster, cfg, train)
    breakdown = (
        ("compute", compute),
        ("tp/cp/ep exposed", layer_exposed),
        ("pp p2p exposed", p2p_exposed),
        ("pipeline bubble", pipe.bubble),
        ("dp exposed", dp_exposed),
        ("dp contention", dp_contention),
        ("tied embedding sync", tied),
        ("optimizer", optimizer),
    )
    result = SimResult(
        config=cfg,
        step_time_s=step,
        mfu=flops / (step * world * dev.peak_flops(train.dtype)),
        tflops_per_device=flops / step / world / 1e12,
        tokens_per_s=train.tokens / step,
        peak_memory_bytes=mem.total,
        memory=mem,
        fits=mem.total <= dev.hbm_bytes,
        exposed_comm_s=layer_exposed + p2p_exposed + dp_exposed + tied,
        bubble_s=pipe.bubble,
        compute_s=compute,
        optimizer_s=optimizer,
        num_microbatches=m,
        breakdown=breakdown,
        a2a_bytes=m * _per_stage(model, cfg, costs, "a2a_bytes"),
        a2a_exposed_s=m * _per_stage(model, cfg, costs, "a2a_exposed_s"),
    )
    if not timeline:
        return result
    acts = {k: layer_activation_bytes(model, cfg, train, k) for k, _ in _kinds(model)}
    sched = StageSchedule(
        model=model,
        cfg=cfg,
        train=train,
        m=m,
        dense=costs.get("dense"),
        moe=costs.get("moe"),
        emb=emb,
        head=head if cfg.pp == 1 else None,
        dense_act=acts.get("dense", 0.0),
        moe_act=acts.get("moe", 0.0),
        pipeline_s=pipe.total,
        gather_s=dp.gather,
        gather_exposed_s=dp.fwd_exposed,
        reduce_s=dp.reduce,
        reduce_exposed_s=dp.bwd_exposed + dp_contention + tied,
        optimizer_s=optimizer,
        static_bytes=memory_breakdown(model, cluster, cfg, train, "first").static,
    )
    events, points = build_timeline(sched)
    return replace(result, events=events, memory_timeline=points)
