"""Cluster simulator: one optimizer step of a transformer under a ParallelConfig, analytically.

Stages hold the layers ``stagesplit`` gives (``passes.stages.split_layers`` on the simulator's own
layer, embedding and head times, under each stage's memory). The step of the slowest pipeline
rank is ``m`` micro-batches of forward + backward (repeated layers costed once, see ``layer``),
plus the pipeline bubble ``(pp - 1) / vpp`` stage-passes (so its share of the ideal time is
``(pp - 1) / (vpp m)``; ZB-H1 leaves only the forward and input-gradient part of those passes in
the bubble), plus whatever data-parallel traffic the buckets cannot hide (``dataparallel``), plus the
optimizer. The busiest expert rank and the slowest stage set the pace; on a cluster of node
groups with different NICs each rank's collectives run at the NICs of the nodes they touch
(``comm.instance_view``). Deterministic.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, replace

from meshfold.passes.cost import comm, opcost
from meshfold.passes.stages import ramp_s
from meshfold.sim.dataparallel import data_parallel, fsdp_floor
from meshfold.sim.edges import embedding_cost, head_cost
from meshfold.sim.footprint import (
    StageLayers,
    StageParams,
    layer_activation_bytes,
    stage_memory,
    stage_params,
)
from meshfold.sim.layer import LayerPlan, expert_floor, layer_cost
from meshfold.sim.model import ModelSpec
from meshfold.sim.parallel import ConfigError, ParallelConfig, TrainSpec
from meshfold.sim.result import MemoryBreakdown, SimResult
from meshfold.sim.stage_timeline import StageSchedule, build_timeline
from meshfold.sim.stagesplit import PipelineStages, plan_stages
from meshfold.sim.streams import LayerCost
from meshfold.sim.trace import plot_memory, to_chrome_trace
from meshfold.target.hardware import Cluster

__all__ = ["ConfigError", "ParallelConfig", "SimResult", "TrainSpec", "plot_memory", "simulate", "to_chrome_trace"]


@dataclass(frozen=True, slots=True)
class _Stage:
    """One pipeline rank's seconds per micro-batch (all its chunks): forward, backward (with
    recomputation), the part of both spent waiting on layer collectives, weight-gradient GEMMs,
    and the expert all-to-all bytes and waits."""

    fwd: float
    bwd: float
    exposed: float
    wgrad: float = 0.0
    a2a_bytes: float = 0.0
    a2a_exposed: float = 0.0

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


def _optimizer_time(cluster: Cluster, cfg: ParallelConfig, train: TrainSpec, sp0: StageParams) -> float:
    """Seconds of the (memory-bound) optimizer update of one rank's shard of the parameters."""
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


def _hops(cluster: Cluster, model: ModelSpec, cfg: ParallelConfig, train: TrainSpec) -> tuple[float, ...]:
    """Seconds of one activation send across each stage boundary (rank ``i`` to ``i + 1``), at the
    slower NIC of its two ends."""
    if cfg.pp == 1:
        return ()
    tsp = cfg.micro_batch_size * train.seq_len / cfg.cp / (cfg.tp if cfg.sp else 1)
    return _hop_times(cluster, cfg.attention_axes(), tsp * model.hidden * train.act_bytes)


@functools.lru_cache(maxsize=4096)
def _hop_times(cluster: Cluster, axes: tuple[tuple[str, int], ...], nbytes: float) -> tuple[float, ...]:
    """``_hops`` of ``nbytes`` sends along the pp axis of the mesh ``axes`` (cached: the search
    asks for every schedule and layout of one mesh)."""
    out = []
    for i in range(dict(axes)["pp"] - 1):
        view, cross = comm.hop(cluster, axes, "pp", i)
        out.append(comm.p2p(view, nbytes, cross_node=cross))
    return tuple(out)


def _pipeline(
    hops: tuple[float, ...], pp: int, vpp: int, schedule: str, m: int, slow_total: float, slow_wgrad: float
) -> _Pipeline:
    """``m`` micro-batches of the slowest stage, the bubble (``passes.stages.ramp_s``, the rule the
    runtime chooses its schedule by) and activation sends (the slowest hop every micro-batch; each
    hop once each way to fill and drain). NOTE: the paper's ZB-H1 reaches ``(pp - 1) (F + B - W)``
    by also reordering the warm-up; ``ramp_s`` prices the smaller gain, ``(pp - 1) (F + B)``."""
    p2p = max(hops, default=0.0)
    p2p_per_mb = 2 * p2p if vpp == 1 else 0.0  # NOTE: the interleaved schedule overlaps its sends
    p2p_fill = 2 * sum(hops)
    bubble = ramp_s(pp, vpp, slow_total, slow_wgrad, schedule == "zb-h1")
    return _Pipeline(m * (slow_total + p2p_per_mb) + bubble + p2p_fill, bubble, p2p_per_mb, p2p_fill)


@functools.lru_cache(maxsize=256)
def _flops_per_token(model: ModelSpec, seq_len: int, causal: bool) -> float:
    """Model FLOPs per trained token (cached: the search asks once per configuration)."""
    return model.flops_per_token(seq_len, causal=causal)


def _kinds(model: ModelSpec) -> tuple[tuple[str, int], ...]:
    """(layer kind, count) of the kinds ``model`` has."""
    return tuple((k, n) for k, n in (("dense", model.dense_layers), ("moe", model.moe_layers)) if n)


def _rank_stage(layers: StageLayers, costs: dict[str, LayerCost], emb: LayerCost, head: LayerCost) -> _Stage:
    """Seconds per micro-batch of the pipeline rank holding ``layers`` (and its edges)."""
    parts = [(costs[k], n) for k, n in (("dense", layers.dense), ("moe", layers.moe)) if n]
    parts += [(emb, 1)] if layers.embedding else []
    parts += [(head, 1)] if layers.head else []
    return _Stage(
        sum(c.fwd_s * n for c, n in parts),
        sum(c.bwd_s * n for c, n in parts),
        sum((c.fwd_exposed_s + c.bwd_exposed_s) * n for c, n in parts),
        sum(c.wgrad_s * n for c, n in parts),
        sum(c.a2a_bytes * n for c, n in parts),
        sum(c.a2a_exposed_s * n for c, n in parts),
    )


@dataclass(frozen=True, slots=True)
class _Costed:
    """The costed micro-batch of a configuration: layer and edge costs, stages, pipeline."""

    plan: LayerPlan
    costs: dict[str, LayerCost]
    emb: LayerCost
    head: LayerCost
    stages: PipelineStages
    ranks: tuple[_Stage, ...]
    slow: _Stage
    pipe: _Pipeline


def _edge_costs(
    model: ModelSpec, cluster: Cluster, cfg: ParallelConfig, train: TrainSpec
) -> tuple[LayerPlan, dict[str, LayerCost], LayerCost, LayerCost]:
    """(plan, per-kind layer costs, embedding, head) of ``cfg`` (``_layer_args``)."""
    plan = layer_plan(cluster, cfg)
    args = _layer_args(model, cluster, train)
    costs = {k: layer_cost(*args, plan, k) for k, _ in _kinds(model)}
    edge_plan = replace(plan.dense_view(), recompute="none")  # NOTE: edges never recompute
    slowest = args[1]
    emb = embedding_cost(model, slowest, train.dtype, train.grad_dtype, train.seq_len, edge_plan)
    head = head_cost(model, slowest, train.dtype, train.grad_dtype, train.seq_len, edge_plan)
    return plan, costs, emb, head


def _layer_args(
    model: ModelSpec, cluster: Cluster, train: TrainSpec
) -> tuple[ModelSpec, Cluster, str, str, bool, bool, int]:
    """The arguments of ``layer_cost`` before the plan: layer collectives that leave a node run at
    the cluster's slowest NIC (every node group holds some of their instances)."""
    slowest = cluster.view(frozenset(range(len(cluster.groups))))
    return model, slowest, train.dtype, train.grad_dtype, train.causal, train.flash_attention, train.seq_len


def _costed(model: ModelSpec, cluster: Cluster, cfg: ParallelConfig, train: TrainSpec) -> _Costed:
    """Cost the layers, edges, stages and pipeline of a validated ``cfg`` (cached; data-parallel
    overlap changes none of them, so configurations that differ only there share)."""
    return _costed_cached(model, cluster, replace(cfg, dp_overlap=True), train)


@functools.lru_cache(maxsize=1024)
def _costed_cached(model: ModelSpec, cluster: Cluster, cfg: ParallelConfig, train: TrainSpec) -> _Costed:
    """``_costed`` on a configuration whose data-parallel overlap is normalised."""
    plan, costs, emb, head = _edge_costs(model, cluster, cfg, train)
    times = {k: c.fwd_s + c.bwd_s for k, c in costs.items()}
    memory = stage_memory(model, cfg, train)
    edges = (emb.fwd_s + emb.bwd_s, head.fwd_s + head.bwd_s)
    stages = plan_stages(model, cfg, times, *edges, memory, cluster.device.hbm_bytes)
    ranks = tuple(_rank_stage(r, costs, emb, head) for r in stages.ranks)
    slow = max(ranks, key=lambda s: s.total)
    m = cfg.num_microbatches(train)
    pipe = _pipeline(_hops(cluster, model, cfg, train), cfg.pp, cfg.vpp, cfg.schedule, m, slow.total, slow.wgrad)
    return _Costed(plan, costs, emb, head, stages, ranks, slow, pipe)


def pipeline_time(model: ModelSpec, cluster: Cluster, config: ParallelConfig, train: TrainSpec) -> float:
    """Seconds of the pipeline part of a step of a valid ``config`` (micro-batches of the slowest
    stage, bubble, stage-to-stage sends). Every other part of ``simulate``'s step time is
    non-negative, so this is a lower bound of it."""
    return _costed(model, cluster, config, train).pipe.total


@dataclass(frozen=True, slots=True)
class PipelineFloor:
    """What bounds the pipeline part of a step from below before its stages are split, for every
    schedule of one mesh, micro-batch size, recomputation and expert layout (the search prices a
    group of configurations with one): ``m`` micro-batches of the mean rank (all ranks together
    take ``fwd`` + ``bwd`` seconds a micro-batch), of which at most ``share`` is weight-gradient
    work, and the stage-to-stage sends ``hops``."""

    pp: int
    m: int
    fwd: float
    bwd: float
    share: float
    hops: tuple[float, ...]

    def at(self, vpp: int, schedule: str) -> float:
        """The bound under ``vpp`` chunks a rank and ``schedule``."""
        mean = (self.fwd + self.bwd) / self.pp
        return _pipeline(self.hops, self.pp, vpp, schedule, self.m, mean, mean * self.share).total

    def least(self, schedules: set[tuple[int, str]]) -> float:
        """The smallest bound over ``schedules`` ((vpp, schedule) pairs). With vpp > 1 the bound
        falls as vpp grows (the bubble is ``(pp - 1) / vpp`` passes), so only the largest counts."""
        deepest = max((v for v, _ in schedules), default=1)
        return min(self.at(v, s) for v, s in schedules if v == 1 or v == deepest)


def pipeline_floor(model: ModelSpec, cluster: Cluster, config: ParallelConfig, train: TrainSpec) -> PipelineFloor:
    """The ``PipelineFloor`` of ``config``: it reads neither ``vpp``, ``schedule`` nor ``zero``, so
    configurations that differ only there share it. The slowest rank takes at least the mean rank's
    time, and under ZB-H1 at most the largest weight-gradient share of any part of a pass leaves
    the bubble."""
    _, costs, emb, head = _edge_costs(model, cluster, config, train)
    parts = [(costs[k], n) for k, n in _kinds(model)] + [(emb, 1), (head, 1)]
    return _floor_of(config.pp, config.num_microbatches(train), parts, _hops(cluster, model, config, train))


def _floor_of(
    pp: int, m: int, parts: list[tuple[LayerCost, int]], hops: tuple[float, ...], extra: tuple[float, float] = (0, 0)
) -> PipelineFloor:
    """The floor of a pass made of ``parts`` ((cost, count) pairs) over ``pp`` ranks; ``extra``
    (forward, backward seconds) is a part whose weight-gradient share is not known, so the share
    is taken as 1 (no bubble left under ZB-H1) when it is given."""
    fwd = sum(c.fwd_s * n for c, n in parts) + extra[0]
    bwd = sum(c.bwd_s * n for c, n in parts) + extra[1]
    share = max((c.wgrad_s / (c.fwd_s + c.bwd_s) for c, _ in parts if c.fwd_s + c.bwd_s > 0), default=0.0)
    return PipelineFloor(pp, m, fwd, bwd, 1.0 if extra[0] + extra[1] > 0 else share, hops)


def _inner(axes: tuple[tuple[str, int], ...], names: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """The axes of ``axes`` (innermost first) up to the outermost of ``names``: where a group over
    ``names`` sits depends on these alone (``comm.place_axes``)."""
    last = max((i for i, (a, _) in enumerate(axes) if a in names), default=-1)
    return axes[: last + 1]


class Floors:
    """``pipeline_floor`` of many configurations of one model, cluster and step (the search asks
    for one per group of configurations, tens of thousands at scale): the layers, edges and sends
    that configurations share are costed once, keyed by exactly what their costs read."""

    def __init__(self, model: ModelSpec, cluster: Cluster, train: TrainSpec) -> None:
        self.model, self.cluster, self.train = model, cluster, train
        self._attention: dict[tuple[object, ...], list[tuple[LayerCost, int]]] = {}
        self._experts: dict[tuple[object, ...], LayerCost] = {}

    def _dense(self, cfg: ParallelConfig) -> tuple[tuple[object, ...], list[tuple[LayerCost, int]]]:
        """(key, parts): what the costs of ``cfg``'s layers read apart from the expert layout, and
        its dense layers and edges (their costs read the dense view of the plan)."""
        overlap = cfg.tp_comm_overlap and cfg.tp > 1
        inner = _inner(cfg.attention_axes(), ("tp", "cp"))
        layer: tuple[object, ...] = (
            cfg.tp,
            cfg.cp,
            cfg.sp,
            cfg.micro_batch_size,
            cfg.recompute,
            overlap,
            cfg.cp_method,
            inner,
        )
        dense = self._attention.get(layer)
        if dense is None:
            _, costs, emb, head = _edge_costs(self.model, self.cluster, cfg, self.train)
            n = self.model.dense_layers
            dense = self._attention[layer] = [*([(costs["dense"], n)] if n else []), (emb, 1), (head, 1)]
        return layer, dense

    def layouts(self, cfg: ParallelConfig, layouts: Iterable[tuple[int, int]]) -> PipelineFloor:
        """A floor of every configuration that differs from ``cfg`` at most in its expert layout,
        one of ``layouts`` ((ep, etp) pairs): MoE layers at ``layer.expert_floor``."""
        _, dense = self._dense(cfg)
        model, train = self.model, self.train
        extra = (0.0, 0.0)
        if model.moe_layers:
            fwd, bwd = expert_floor(*_layer_args(model, self.cluster, train), layer_plan(self.cluster, cfg), layouts)
            extra = (fwd * model.moe_layers, bwd * model.moe_layers)
        return _floor_of(cfg.pp, cfg.num_microbatches(train), dense, _hops(self.cluster, model, cfg, train), extra)

    def __call__(self, cfg: ParallelConfig) -> PipelineFloor:
        """``pipeline_floor(model, cluster, cfg, train)``."""
        model = self.model
        layer, dense = self._dense(cfg)
        parts = dense[:-2]
        if model.moe_layers:
            experts = (*layer, cfg.ep, cfg.etp_size, _inner(cfg.expert_axes(), ("ep", "etp")))
            moe = self._experts.get(experts)
            if moe is None:
                moe = self._experts[experts] = _edge_costs(model, self.cluster, cfg, self.train)[1]["moe"]
            parts = [*parts, (moe, model.moe_layers)]
        parts += dense[-2:]
        return _floor_of(cfg.pp, cfg.num_microbatches(self.train), parts, _hops(self.cluster, model, cfg, self.train))


def pipeline_lower_bound(model: ModelSpec, cluster: Cluster, config: ParallelConfig, train: TrainSpec) -> float:
    """A lower bound of ``pipeline_time`` that needs no stage split (``PipelineFloor``)."""
    return pipeline_floor(model, cluster, config, train).at(config.vpp, config.schedule)


def step_lower_bound(
    model: ModelSpec, cluster: Cluster, config: ParallelConfig, train: TrainSpec, floor: PipelineFloor | None = None
) -> float:
    """A lower bound of ``simulate``'s step time that needs no stage split: the pipeline's floor
    under ``config``'s schedule plus FSDP's floor of exposed data-parallel traffic
    (``dataparallel.fsdp_floor``); every other part of the step is non-negative. ``floor`` is
    ``pipeline_floor`` of ``config`` when known (any configuration of its group has it)."""
    floor = floor or pipeline_floor(model, cluster, config, train)
    dp = fsdp_floor(cluster, model, config, train, floor.m, floor.fwd, floor.bwd)
    return floor.at(config.vpp, config.schedule) + dp


def peak_memory(model: ModelSpec, cluster: Cluster, cfg: ParallelConfig, train: TrainSpec) -> MemoryBreakdown:
    """Peak bytes per device of the pipeline rank that needs the most, under its own layers, edges
    and micro-batches in flight (``stage_memories`` has every rank's). Raises ConfigError when
    ``cfg`` cannot run."""
    return max(stage_memories(model, cluster, cfg, train), key=lambda b: b.total)


@functools.lru_cache(maxsize=4096)
def stage_memories(
    model: ModelSpec, cluster: Cluster, cfg: ParallelConfig, train: TrainSpec
) -> tuple[MemoryBreakdown, ...]:
    """Peak bytes per device of each pipeline rank, rank 0 first (cached)."""
    cfg.validate(model, cluster, train)
    memory = stage_memory(model, cfg, train)
    return tuple(memory.breakdown(r) for r in _costed(model, cluster, cfg, train).stages.ranks)


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
    costs, emb, head, slow, pipe = c.costs, c.emb, c.head, c.slow, c.pipe
    passes = [(r.fwd, r.bwd) for r in c.ranks]
    dp = data_parallel(cluster, model, cfg, train, m, c.stages, passes, (slow.fwd, slow.bwd))
    dp_exposed = dp.fwd_exposed + dp.bwd_exposed
    dp_contention = dev.eff.contention * (dp.total - dp_exposed)
    tied = 0.0
    if model.tied_embeddings and cfg.pp > 1:
        view = comm.instance_view(cluster, cfg.attention_axes(), ("pp",), ())
        tied = comm.all_reduce(view, comm.Group(2, 1, 2), model.vocab * model.hidden / cfg.tp * train.grad_bytes)
    # NOTE: every rank steps its optimizer at once; the one with the most parameters ends last
    optimizer = max(_optimizer_time(cluster, cfg, train, stage_params(model, cfg, r)) for r in c.stages.ranks)

    step = pipe.total + dp_exposed + dp_contention + tied + optimizer
    flops = _flops_per_token(model, train.seq_len, train.mfu_causal) * train.tokens
    world = cluster.world_size
    layer_exposed = m * slow.exposed
    compute = m * slow.total - layer_exposed
    p2p_exposed = m * pipe.p2p_per_mb + pipe.p2p_fill
    peaks = stage_memories(model, cluster, cfg, train)
    mem = max(peaks, key=lambda b: b.total)
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
        a2a_bytes=m * slow.a2a_bytes,
        a2a_exposed_s=m * slow.a2a_exposed,
        stage_layers=c.stages.counts,
        stage_peak_bytes=tuple(b.total for b in peaks),
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
        static_bytes=peaks[0].static,
        chunk_bounds=c.stages.chunk_bounds(0),
    )
    events, points = build_timeline(sched)
    return replace(result, events=events, memory_timeline=points)
