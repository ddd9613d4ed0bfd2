"""Event and memory timelines of pipeline stage 0 (rank 0), laid out from the costed parts.

Stage 0 runs Megatron's (interleaved) 1F1B order: warm-up forwards, then one forward and one
backward per slot, then cool-down backwards. The idle time the analytic step assigns to this
stage (pipeline bubble plus waiting on slower stages) is drawn as one ``pipeline bubble`` gap
after the warm-up, so the timeline ends exactly at the simulated step time. Data-parallel
traffic is drawn at its step-level place (gather at the start, reduction at the end), FSDP's
per-micro-batch traffic lumped there too.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.sim.model import ModelSpec
from meshfold.sim.parallel import ParallelConfig, TrainSpec
from meshfold.sim.result import MemoryPoint, TimelineEvent
from meshfold.sim.streams import LayerCost


@dataclass(frozen=True, slots=True)
class StageSchedule:
    """Everything the stage-0 timeline needs (costs per micro-batch, step-level times)."""

    model: ModelSpec
    cfg: ParallelConfig
    train: TrainSpec
    m: int
    dense: LayerCost | None
    moe: LayerCost | None
    emb: LayerCost
    head: LayerCost | None
    dense_act: float
    moe_act: float
    pipeline_s: float
    gather_s: float
    gather_exposed_s: float
    reduce_s: float
    reduce_exposed_s: float
    optimizer_s: float
    static_bytes: float
    chunk_bounds: tuple[tuple[int, int], ...]
    """(first layer, end) of each of stage 0's virtual chunks (the stage split's)."""


def schedule_order(pp: int, vpp: int, m: int) -> list[tuple[str, int, int]]:
    """Stage 0's (pass, micro-batch, chunk) sequence under (interleaved) 1F1B."""
    total = m * vpp
    if pp == 1:
        return [(p, mb, 0) for mb in range(m) for p in ("F", "B")]
    warmup = min(total, pp - 1 if vpp == 1 else 2 * (pp - 1) + (vpp - 1) * pp)

    def item(p: str, k: int) -> tuple[str, int, int]:
        group = k // pp % vpp
        chunk = group if p == "F" else vpp - 1 - group
        return (p, k // (pp * vpp) * pp + k % pp, chunk)

    order = [item("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [item("F", warmup + k), item("B", k)]
    order += [item("B", k) for k in range(total - warmup, total)]
    return order


def _chunk_layers(s: StageSchedule, chunk: int) -> list[tuple[int, str]]:
    first, end = s.chunk_bounds[chunk]
    dense_n = s.model.dense_layers
    return [(i, "dense" if i < dense_n else "moe") for i in range(first, end)]


def build_timeline(s: StageSchedule) -> tuple[tuple[TimelineEvent, ...], tuple[MemoryPoint, ...]]:
    """Events (both streams) and memory points of stage 0 over one step."""
    cfg = s.cfg
    events: list[TimelineEvent] = []
    mem: list[MemoryPoint] = [MemoryPoint(0.0, s.static_bytes, "parameters, gradients, optimizer state")]
    if s.gather_s > 0:
        events.append(TimelineEvent("comm", "dp all-gather params", 0.0, s.gather_s, "dp"))
    t = s.gather_exposed_s
    order = schedule_order(cfg.pp, cfg.vpp, s.m)
    warmup = next((i for i, o in enumerate(order) if o[0] == "B"), len(order))
    acts = 0.0
    busy = 0.0
    last_vchunk = cfg.vpp - 1
    for n, (p, mb, chunk) in enumerate(order):
        if n == warmup and cfg.pp > 1:
            items = sum(_item_time(s, c, q) for q, _, c in order)
            gap = max(0.0, s.pipeline_s - items)
            events.append(TimelineEvent("compute", "pipeline bubble", t, gap, "bubble"))
            t += gap
        parts: list[tuple[str, LayerCost]] = []
        if chunk == 0:
            parts.append(("embedding", s.emb))
        parts += [(f"L{i}", _cost(s, kind)) for i, kind in _chunk_layers(s, chunk)]
        if s.head is not None and chunk == last_vchunk:
            parts.append(("head", s.head))
        if p == "B":
            parts.reverse()
        start = t
        for label, cost in parts:
            tmpl, dur = (cost.fwd_events, cost.fwd_s) if p == "F" else (cost.bwd_events, cost.bwd_s)
            events.extend(e.shifted(t, f"mb{mb} {label}: ") for e in tmpl)
            t += dur
        busy += t - start
        delta = _chunk_act(s, chunk)
        acts += delta if p == "F" else -delta
        mem.append(MemoryPoint(t, s.static_bytes + max(0.0, acts), f"{p}{mb}.{chunk}"))
    if s.reduce_s > 0:
        events.append(TimelineEvent("comm", "dp reduce grads", t + s.reduce_exposed_s - s.reduce_s, s.reduce_s, "dp"))
    if s.reduce_exposed_s > 0:
        events.append(TimelineEvent("compute", "wait for dp reduction", t, s.reduce_exposed_s, "dp"))
    t += s.reduce_exposed_s
    events.append(TimelineEvent("compute", "optimizer step", t, s.optimizer_s, "optimizer"))
    mem.append(MemoryPoint(t + s.optimizer_s, s.static_bytes, "optimizer step"))
    return tuple(events), tuple(mem)


def _cost(s: StageSchedule, kind: str) -> LayerCost:
    cost = s.dense if kind == "dense" else s.moe
    assert cost is not None, f"no {kind} layer cost"
    return cost


def _item_time(s: StageSchedule, chunk: int, p: str) -> float:
    total = 0.0
    for _, kind in _chunk_layers(s, chunk):
        c = _cost(s, kind)
        total += c.fwd_s if p == "F" else c.bwd_s
    if chunk == 0:
        total += s.emb.fwd_s if p == "F" else s.emb.bwd_s
    if s.head is not None and chunk == s.cfg.vpp - 1:
        total += s.head.fwd_s if p == "F" else s.head.bwd_s
    return total


def _chunk_act(s: StageSchedule, chunk: int) -> float:
    return sum(s.dense_act if kind == "dense" else s.moe_act for _, kind in _chunk_layers(s, chunk))
