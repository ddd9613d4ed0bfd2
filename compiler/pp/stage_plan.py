"""How a program is pipelined: each layer's cost, the split of layers into stages, and under
``schedule="auto"`` the schedule the time model predicts fastest.

``LayerCosts`` reads, per layer of a program's layer stack (``meshfold.pp.stage_split.Layers``), the time
the passes' time model gives its forward and backward on one rank, the share of it that computes
weight gradients, and the bytes of its parameters and saved activations; ``passes.stages`` splits
by those times under the memory each stage's schedule keeps in flight and predicts a step
(``pipeline_step_s``, the ramp priced as the simulator prices its bubble). ``plan_pipeline``
weighs every schedule ``candidates`` lists when asked to choose.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshfold.ir import Graph, Mesh, Op, Value
from meshfold.ir.dialects.stage import STAGE_IN, STAGE_IN_GRAD
from meshfold.ir.graph import local_nbytes
from meshfold.passes.base import PassError
from meshfold.passes.cost.axis import axis_models
from meshfold.passes.schedule.timeline import Costs
from meshfold.passes.sharding.ilp.program import STATE_COPIES
from meshfold.passes.sharding.opwork import op_flops
from meshfold.passes.stages import (
    AUTO,
    PP,
    PipelineSpec,
    SplitError,
    StageSplit,
    pipeline_step_s,
    split_layers,
    stage_sums,
)
from meshfold.pp.stage_split import Layers, is_mark, placement
from meshfold.target.hardware import Cluster


@dataclass(frozen=True)
class LayerCosts:
    """What each layer of a program costs one rank, then its head (index ``n``: what runs before the
    stack) and tail (``n + 1``: after it): ``times`` seconds of forward and backward for one
    microbatch (kernels and collectives, by the time model the passes use), ``wgrad`` of them the
    weight gradients' (what a zero-bubble schedule runs later), ``params`` bytes of parameters with
    their gradient and two optimizer states, ``saved`` bytes of forward values the backward reads;
    and ``send_s``, the seconds of one send of the hidden states between pipeline ranks."""

    times: tuple[float, ...]
    wgrad: tuple[float, ...]
    params: tuple[float, ...]
    saved: tuple[float, ...]
    send_s: float

    @property
    def n(self) -> int:
        return len(self.times) - 2

    @staticmethod
    def of(graph: Graph, ranks: int, cluster: Cluster | None = None) -> LayerCosts:
        layers = Layers.of(graph)
        n = layers.count
        costs = Costs(graph, axis_models(graph.mesh, cluster)) if graph.mesh is not None else None
        times, wgrad, params, saved = ([0.0] * (n + 2) for _ in range(4))
        where = placement(graph, layers, lambda k: k)
        made_at: dict[Value, int] = {}
        param_at: dict[Value, int] = {}
        kinds = {i.value: i.kind for i in graph.inputs}
        inputs_grad = _input_gradient_ops(graph)
        for op, k, at in zip(graph.ops, layers.layer, where, strict=True):
            # NOTE: an op of the inputs every layer reads (the rotary tables) runs on every stage alike
            at_k = k if k >= 0 else n if at == {0} else n + 1 if at == {n - 1} else -1
            if at_k < 0:
                continue
            t = (costs.compute(op) + costs.comm(op)) if costs is not None else op_flops(op)
            times[at_k] += t
            if op.prov.phase == "bwd" and op not in inputs_grad:
                wgrad[at_k] += t
            for v in op.operands:
                if kinds.get(v) == "param":
                    param_at.setdefault(v, at_k)
                elif op.prov.phase == "bwd" and v in made_at:  # NOTE: a forward value the backward reads
                    saved[made_at.pop(v)] += local_nbytes(v, graph.mesh)
            if op.prov.phase == "fwd":
                made_at.update((r, at_k) for r in op.results)
        for v, at_k in param_at.items():
            params[at_k] += STATE_COPIES * local_nbytes(v, graph.mesh)
        hidden = next(op.operands[0] for op in graph.ops if is_mark(op, STAGE_IN))
        send_s = 0.0
        if costs is not None and graph.mesh is not None:
            # NOTE: priced as if ``pp`` were the outermost axis, the layout a cluster puts it on
            full = Mesh((PP, *graph.mesh.names), (ranks, *graph.mesh.sizes))
            send_s = axis_models(full, cluster)[0].collective("p2p", local_nbytes(hidden, graph.mesh))
        return LayerCosts(*map(tuple, (times, wgrad, params, saved)), send_s=send_s)

    def split(self, spec: PipelineSpec, memory: int | None = None) -> StageSplit:
        """The layers of each of ``spec.stages`` stages (``passes.stages.split_layers``): the head
        weighs on the first stage, the tail on the last; under ``memory`` (bytes a device holds) a
        stage must fit its parameters and the saved activations of each microbatch the schedule
        keeps in flight on it (``PipelineSpec.in_flight``)."""
        n, params, saved = self.n, self.params, self.saved

        def fits(stage: int, first: int, end: int) -> bool:
            assert memory is not None
            extra = [e for e, at in ((n, 0), (n + 1, spec.stages - 1)) if stage == at]
            held = sum(params[first:end]) + sum(params[e] for e in extra)
            acts = sum(saved[first:end]) + sum(saved[e] for e in extra)
            return held + acts * spec.in_flight(stage) <= memory

        return split_layers(
            self.times[:n], spec.stages, head=self.times[n], tail=self.times[n + 1], fits=fits if memory else None
        )

    def step_s(self, spec: PipelineSpec, split: StageSplit) -> float:
        """Predicted seconds of one step of ``spec`` over ``split`` (``passes.stages.pipeline_step_s``)."""
        n = self.n
        wgrad = stage_sums(self.wgrad[:n], split.bounds, self.wgrad[n], self.wgrad[n + 1])
        zero_bubble = spec.schedule == "zero-bubble"
        return pipeline_step_s(split, wgrad, spec.ranks, spec.microbatches, zero_bubble=zero_bubble, send_s=self.send_s)


def _input_gradient_ops(graph: Graph) -> set[Op]:
    """The backward ops a stage's input gradient needs (every ``stage_in_grad`` and what it reads):
    the rest of the backward computes weight gradients only."""
    made = {r: op for op in graph.ops if op.prov.phase == "bwd" for r in op.results}
    need: set[Op] = set()
    todo = [op for op in graph.ops if is_mark(op, STAGE_IN_GRAD)]
    while todo:
        op = todo.pop()
        if op in need:
            continue
        need.add(op)
        todo.extend(m for v in op.operands if (m := made.get(v)) is not None)
    return need


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline as it will run: its ``spec``, the ``split`` of layers, the predicted seconds of a
    step, and, when the schedule was chosen (``schedule="auto"``), every candidate weighed with its
    predicted seconds (None: no split fits memory)."""

    spec: PipelineSpec
    split: StageSplit
    step_s: float
    weighed: tuple[tuple[PipelineSpec, float | None], ...] = ()


def plan_pipeline(
    graph: Graph, spec: PipelineSpec, cluster: Cluster | None = None, memory: int | None = None
) -> PipelinePlan:
    """``spec``'s split of ``graph`` (``LayerCosts.split``); with ``schedule="auto"``, the schedule
    and stages per rank predicted fastest (``candidates``) among those whose split fits ``memory``."""
    costs = LayerCosts.of(graph, spec.ranks, cluster)
    if spec.schedule != AUTO:
        split = costs.split(spec, memory)
        return PipelinePlan(spec, split, costs.step_s(spec, split))
    weighed: list[tuple[PipelineSpec, float | None]] = []
    best: PipelinePlan | None = None
    for cand in candidates(spec, costs.n):
        try:
            split = costs.split(cand, memory)
        except SplitError:
            weighed.append((cand, None))
            continue
        t = costs.step_s(cand, split)
        weighed.append((cand, t))
        if best is None or t < best.step_s * (1 - 1e-9):
            best = PipelinePlan(cand, split, t)
    if best is None:
        raise PassError(
            f"pp schedule auto: no schedule splits {costs.n} layers over {spec.ranks} pipeline ranks within "
            f"memory={memory} bytes a device; give more memory, more ranks, or memory='full' (recompute)"
        )
    return replace(best, weighed=tuple(weighed))


def candidates(spec: PipelineSpec, layers: int) -> list[PipelineSpec]:
    """The schedules ``schedule="auto"`` weighs for ``spec``'s ranks and microbatches, in the order
    ties go to: 1F1B, zero bubble, interleaved and looped zero bubble with 2, 3, ... stages a rank
    (as many as the layers fill; looped schedules only when the microbatches come in rounds of the
    ranks), GPipe (as fast as 1F1B, holding more)."""
    p, m = spec.ranks, spec.microbatches
    out = [PipelineSpec(p, "1f1b", m), PipelineSpec(p, "zero-bubble", m)]
    if m % p == 0 and p > 1:
        out += [PipelineSpec(p, s, m, v) for v in range(2, layers // p + 1) for s in ("interleaved", "zero-bubble")]
    else:
        out = out[:1]
    return [*out, PipelineSpec(p, "gpipe", m)]


def split_program(
    graph: Graph, spec: PipelineSpec, cluster: Cluster | None = None, memory: int | None = None
) -> StageSplit:
    """The layers of each of ``spec.stages`` stages of ``graph`` (``LayerCosts.split``)."""
    return LayerCosts.of(graph, spec.ranks, cluster).split(spec, memory)


def pipeline_line(plan: PipelinePlan) -> str:
    """The plan report's line for a pipeline: schedule, microbatches and each stage's layers, and
    when the schedule was chosen, the predicted step of it and of the others weighed."""
    spec = plan.spec
    per = f", {spec.virtual} per rank" if spec.virtual > 1 else ""
    line = (
        f"pipeline over {PP!r} ({spec.ranks} ranks{per}), {spec.schedule} schedule, {spec.microbatches} "
        f"microbatches: {plan.split.describe()}"
    )
    if not plan.weighed:
        return line
    timed = sorted(((t, c.label) for c, t in plan.weighed if t is not None), key=lambda x: x[0])
    others = ", ".join(f"{name} {t / plan.step_s:.2f}x" for t, name in timed if name != spec.label)
    unfit = [c.label for c, t in plan.weighed if t is None]
    tail = f"; no split fits memory: {', '.join(unfit)}" if unfit else ""
    return f"{line}; schedule chosen by the time model (predicted step {plan.step_s * 1e3:.3g} ms; {others}{tail})"
