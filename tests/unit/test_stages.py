"""Pipeline stages: the split rule (``passes.stages``), the pipeline options, and a captured program cut
into stage programs (``meshfold.pp.stage_split``). The multi-rank equivalence is in tests/dist/test_pipeline.py."""

from __future__ import annotations

import re
import warnings
from contextlib import nullcontext
from itertools import combinations, pairwise

import pytest
import torch
from torch import nn

from meshfold.ir.dialects.stage import STAGE_IN, STAGE_IN_GRAD
from meshfold.passes import PassError
from meshfold.passes.options import Options
from meshfold.passes.stages import PipelineSpec, SplitError, StageSplit, even_split, pipeline_step_s, split_layers
from meshfold.pp.stage_plan import LayerCosts, candidates, pipeline_line, plan_pipeline, split_program
from meshfold.pp.stage_split import Layers, stage_graphs
from meshfold.pp.tied import tied_parameters
from meshfold.session import compile_model
from meshfold.tools.zoo import build
from meshfold.tools.zoo.models import DecoderLayer, _small_init


def _slowest_by_search(times: list[float], stages: int, head: float, tail: float) -> float:
    """The best slowest-stage time over every way to cut ``times`` into ``stages`` non-empty runs."""
    best = float("inf")
    for cuts in combinations(range(1, len(times)), stages - 1):
        bounds = (0, *cuts, len(times))
        t = [sum(times[a:b]) for a, b in pairwise(bounds)]
        t[0] += head
        t[-1] += tail
        best = min(best, max(t))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_split_is_as_fast_as_the_best_of_every_split(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    times = [float(x) for x in torch.rand(9, generator=gen) + 0.2]
    head, tail = float(torch.rand(1, generator=gen)), 2 * float(torch.rand(1, generator=gen))
    for stages in (2, 3, 4):
        split = split_layers(times, stages, head=head, tail=tail)
        assert sum(split.counts) == 9 and min(split.counts) >= 1
        assert split.slowest == pytest.approx(_slowest_by_search(times, stages, head, tail))


def test_heavy_first_and_last_stages_hold_fewer_layers() -> None:
    """Llama 3 405B's 126 layers over 16 stages, embedding and output layer each about a layer's time:
    the first and last stages get one layer less than the others, as its training run trimmed them."""
    split = split_layers([1.0] * 126, 16, head=1.0, tail=1.0)
    assert split.counts[0] == split.counts[-1] == 7
    assert set(split.counts[1:-1]) == {8}
    assert even_split(8, 4).counts == (2, 2, 2, 2)
    assert sum(even_split(61, 8).counts) == 61 and max(even_split(61, 8).counts) == 8


def test_a_stage_that_does_not_fit_is_never_chosen() -> None:
    # NOTE: stage 0 may hold at most 2 layers (its 1F1B stage keeps the most microbatches in flight)
    split = split_layers([1.0] * 8, 2, fits=lambda s, a, b: s != 0 or b - a <= 2)
    assert split.counts == (2, 6)
    with pytest.raises(SplitError, match="fits"):
        split_layers([1.0] * 8, 2, fits=lambda s, a, b: b - a <= 3)
    with pytest.raises(SplitError, match="3 layers cannot fill 4"):
        split_layers([1.0] * 3, 4)


def test_pipeline_options_take_the_pp_axis_off_the_mesh_and_the_plan() -> None:
    opts = Options.of(mesh="pp=2,dp=2", plan="pp+fsdp", pp={"schedule": "1f1b", "microbatches": 4})
    assert opts.mesh is not None and opts.mesh.names == ("dp",) and opts.pp == PipelineSpec(2, "1f1b", 4, 1)
    assert opts.plan is not None and opts.plan.preset == "fsdp"
    alone = Options.of(mesh="pp=4", pp={"schedule": "interleaved", "microbatches": 8})
    assert alone.mesh is not None and alone.mesh.names == ("dp",) and alone.mesh.sizes == (1,)
    assert alone.pp is not None and alone.pp.stages == 8 and alone.pp.held(1) == [1, 5]
    with pytest.raises(PassError, match="axis named 'pp'"):
        Options.of(mesh="dp=2", plan="pp+fsdp")
    with pytest.raises(PassError, match="multiple of 4"):
        Options.of(mesh="pp=4", pp={"schedule": "interleaved", "microbatches": 6})
    with pytest.raises(PassError, match="not one of"):
        Options.of(mesh="pp=2", pp={"schedule": "zigzag"})
    with pytest.raises(PassError, match="only the interleaved"):
        Options.of(mesh="pp=2", pp={"schedule": "1f1b", "virtual": 2})
    # NOTE: plan="auto" chooses the schedule where none is given
    auto = Options.of(mesh="pp=2,dp=2", plan="pp+auto", pp={"microbatches": 4})
    assert auto.pp == PipelineSpec(2, "auto", 4, 0) and auto.plan is not None and auto.plan.preset == "auto"
    given = Options.of(mesh="pp=2,dp=2", plan="pp+auto", pp={"schedule": "gpipe"})
    assert given.pp == PipelineSpec(2, "gpipe", 2, 1)
    with pytest.raises(PassError, match="chooses the stages per rank too"):
        Options.of(mesh="pp=2", pp={"schedule": "auto", "virtual": 2})


def test_the_step_model_has_the_schedules_bubbles() -> None:
    """Equal stages and free sends: the predicted step's idle share is ``(p - 1) / (v m + p - 1)``
    under GPipe, 1F1B and interleaving; zero bubble idles only for the forward and input-gradient
    part of the ramp; each send adds its time ``2 v`` times a microbatch and twice per boundary."""
    for spec in (PipelineSpec(4, "1f1b", 8), PipelineSpec(4, "gpipe", 8), PipelineSpec(4, "interleaved", 8, 2)):
        split = StageSplit(tuple(range(spec.stages + 1)), (1.0,) * spec.stages)
        step = pipeline_step_s(split, [0.0] * spec.stages, 4, 8, zero_bubble=False, send_s=0.0)
        busy = 8 * spec.virtual
        assert (step - busy) / step == pytest.approx(spec.bubble())
    split = StageSplit((0, 1, 2, 3, 4), (1.0,) * 4)
    zb = pipeline_step_s(split, [0.25] * 4, 4, 8, zero_bubble=True, send_s=0.0)
    assert zb == pytest.approx(8 + 3 * 0.75)
    sent = pipeline_step_s(split, [0.0] * 4, 4, 8, zero_bubble=False, send_s=0.1)
    assert sent == pytest.approx(8 * (1 + 0.2) + 3 + 2 * 3 * 0.1)
    # NOTE: the busiest rank sets the pace: rank 1 holds stages 1 and 3 of an interleaved split
    uneven = StageSplit((0, 1, 2, 3, 4), (1.0, 2.0, 1.0, 2.0))
    assert pipeline_step_s(uneven, [0.0] * 4, 2, 4, zero_bubble=False, send_s=0.0) == pytest.approx(4 * 4 + 4 / 2)


def _llama(layers: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model, inputs = build("llama-tiny")
    model.layers = nn.ModuleList(DecoderLayer(64, 128, 0, True) for _ in range(layers))
    model.apply(_small_init)
    return model, inputs


def _compiled(model: nn.Module, inputs: tuple[torch.Tensor, ...], stages: int) -> object:
    opts = Options.of(mesh=f"pp={stages},dp=1", plan="pp+ddp", pp={"microbatches": stages})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_model(model, inputs, opts, status=lambda _m: nullcontext())


def test_a_program_splits_into_stages_that_pass_on_the_hidden_states_alone() -> None:
    model, inputs = _llama(5)
    result = _compiled(model, inputs, 2)
    graph = result.graph  # type: ignore[attr-defined]
    layers = Layers.of(graph)
    assert layers.family == "layers" and layers.count == 5
    split = split_program(graph, PipelineSpec(2))
    assert result.staged.split == split  # type: ignore[attr-defined]
    assert sum(split.counts) == 5 and split.counts[0] != split.counts[1]  # NOTE: uneven: 5 layers on 2 stages
    first, last = stage_graphs(graph, split)
    # NOTE: every parameter on exactly one stage, each stage returning its own parameters' gradients
    params = {i.name for i in graph.inputs if i.kind == "param"}
    mine = [{i.name for i in g.inputs if i.kind == "param"} for g in (first, last)]
    assert mine[0] | mine[1] == params and not mine[0] & mine[1]
    assert "embed_tokens.weight" in mine[0] and "lm_head.weight" in mine[1]
    for g, names in zip((first, last), mine, strict=True):
        assert {o.name for o in g.outputs if o.kind == "grad" and o.name in params} == names
    # NOTE: the first stage sends one value and takes its gradient; the last takes it and returns the loss
    (sent,) = [o for o in first.outputs if o.kind == "out"]
    received = [i for i in last.inputs if i.kind == "input" and i.name not in ("input_ids", "labels")]
    assert [i.value for i in received] == [sent.value]
    assert [o.name for o in last.outputs if o.kind == "out"] == ["0"]
    assert any(o.kind == "grad" and o.name == sent.value.name for o in last.outputs)
    (tangent,) = [i for i in first.inputs if i.kind == "tangent"]
    assert any(op.target == STAGE_IN_GRAD and tangent.value in op.results for op in graph.ops)
    marks = sum(op.target == STAGE_IN for op in graph.ops)
    assert marks == 5


class _Skip(nn.Module):
    """Layers whose last one also reads the first layer's output: a value no stage boundary can cut."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.layers[0](x)
        h = first
        for layer in self.layers[1:]:
            h = layer(h)
        return (h + first).pow(2).mean()


def test_a_value_that_skips_a_stage_boundary_is_refused_naming_the_op() -> None:
    result = _compiled(_Skip(), (torch.randn(4, 8),), 2)
    graph = result.graph  # type: ignore[attr-defined]
    with pytest.raises(PassError, match=r"on pipeline stage \d reads %\w+, made by .* only the hidden states"):
        stage_graphs(graph, split_program(graph, PipelineSpec(2)))


def test_a_weight_two_stages_read_is_held_by_both_each_returning_its_part_of_the_gradient() -> None:
    model, inputs = build("gpt2-tiny")  # NOTE: its output layer is its token embedding, tied
    result = _compiled(model, inputs, 2)
    graph = result.graph  # type: ignore[attr-defined]
    stages = stage_graphs(graph, split_program(graph, PipelineSpec(2)))
    tied = tied_parameters(stages)
    assert list(tied) == ["wte.weight"] and tied["wte.weight"] == (0, 1)
    for g in stages:
        (part,) = [o for o in g.outputs if o.kind == "grad" and o.name == "wte.weight"]
        assert part.value in {r for op in g.ops for r in op.results}
    # NOTE: the joint graph's sum of the two parts runs on neither stage
    (whole,) = [o.value for o in graph.outputs if o.kind == "grad" and o.name == "wte.weight"]
    assert all(whole not in {r for op in g.ops for r in op.results} for g in stages)


def test_a_model_without_a_layer_stack_is_refused() -> None:
    with pytest.raises(PassError, match="layer stack"):
        _compiled(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),), 2)


def test_a_zero_bubble_stage_computes_its_input_gradient_before_its_weights() -> None:
    from meshfold.backends.eager import RankContext, lower
    from meshfold.backends.weights import lower_split

    model, inputs = _llama(4)
    graph = _compiled(model, inputs, 2).graph  # type: ignore[attr-defined]
    _, last = stage_graphs(graph, split_program(graph, PipelineSpec(2)))
    (received,) = [i.name for i in last.inputs if i.kind == "input" and i.name not in ("input_ids", "labels")]
    rank = RankContext(last.mesh, (0,), ("dp-group",))
    whole, split = lower(last, rank), lower_split(last, rank, received)
    assert split.bwd_outputs == (received,) and split.weights is not None and split.handoff > 0
    params = {i.name for i in last.inputs if i.kind == "param"}
    assert set(split.weight_outputs) == params and set(whole.bwd_outputs) == params | {received}

    def matmuls(gm: torch.fx.GraphModule) -> int:
        return sum(n.op == "call_function" and "mm" in str(n.target) for n in gm.graph.nodes)

    # NOTE: the weights' gradient products (one per linear layer) move out of the first program
    assert matmuls(split.backward) + matmuls(split.weights) == matmuls(whole.backward)
    assert matmuls(split.weights) >= len([p for p in params if "proj" in p or "lm_head" in p])


def test_under_a_memory_bound_the_stage_holding_more_microbatches_gets_fewer_layers() -> None:
    """Under 1F1B on 4 ranks the first stage keeps four microbatches' activations to the last stage's
    one: at the tightest bound any split meets, the first stage holds fewer layers than without a
    bound, the last more."""
    model, inputs = _llama(8)
    graph = _compiled(model, inputs, 4).graph  # type: ignore[attr-defined]
    spec = PipelineSpec(4, "1f1b", 8)
    assert [spec.in_flight(s) for s in range(4)] == [4, 3, 2, 1]
    free = split_program(graph, spec)
    assert split_program(graph, spec, memory=2**40) == free
    with pytest.raises(SplitError, match="fits"):
        split_program(graph, spec, memory=1)
    low, high = 1, 2**40
    while high - low > 1:  # NOTE: the smallest bound some split meets
        mid = (low + high) // 2
        try:
            split_program(graph, spec, memory=mid)
            high = mid
        except SplitError:
            low = mid
    tight = split_program(graph, spec, memory=high)
    assert tight.counts[0] < free.counts[0] and tight.counts[-1] > free.counts[-1], (tight.counts, free.counts)


def test_auto_weighs_each_schedule_as_the_fixed_one_and_takes_the_fastest() -> None:
    model, inputs = _llama(8)
    graph = _compiled(model, inputs, 4).graph  # type: ignore[attr-defined]
    costs = LayerCosts.of(graph, 4)
    n = costs.n
    # NOTE: a layer's weight gradients are part of its backward: a third of a linear's FLOPs, less of
    # the attention and norms; the embedding's backward is its weight's gradient alone
    shares = {round(w / t, 9) for w, t in zip(costs.wgrad[:n], costs.times[:n], strict=True)}
    assert len(shares) == 1 and 0.1 < shares.pop() < 0.4
    assert 0 < costs.wgrad[n] < costs.times[n] and costs.send_s > 0
    auto = PipelineSpec(4, "auto", 8, 0)
    plan = plan_pipeline(graph, auto)
    weighed = dict(plan.weighed)
    assert set(weighed) == set(candidates(auto, n)) and {s.schedule for s in weighed} == {
        "gpipe",
        "1f1b",
        "interleaved",
        "zero-bubble",
    }
    for spec, t in weighed.items():
        assert t == pytest.approx(plan_pipeline(graph, spec).step_s)
    assert plan.step_s == min(t for t in weighed.values() if t is not None) == weighed[plan.spec]
    # NOTE: 1F1B and GPipe pass as much work and as many sends; the weights' gradients shorten zero bubble's ramp
    assert weighed[PipelineSpec(4, "1f1b", 8)] == weighed[PipelineSpec(4, "gpipe", 8)]
    assert weighed[PipelineSpec(4, "zero-bubble", 8)] < weighed[PipelineSpec(4, "1f1b", 8)]
    line = pipeline_line(plan)
    assert "schedule chosen by the time model" in line and re.search(r"gpipe \d+\.\d\dx", line), line
    # NOTE: microbatches that are no multiple of the ranks leave the looped schedules out
    assert {s.schedule for s in candidates(PipelineSpec(4, "auto", 6, 0), n)} == {"1f1b", "gpipe"}


def test_auto_leaves_out_the_schedules_whose_stages_do_not_fit_memory() -> None:
    """GPipe keeps every microbatch's activations on every stage, 1F1B at most ``p - s``: at a bound
    between their needs GPipe is weighed as not fitting and never chosen; below every need, auto
    raises naming what to do."""
    model, inputs = _llama(8)
    graph = _compiled(model, inputs, 4).graph  # type: ignore[attr-defined]
    costs = LayerCosts.of(graph, 4)

    def need(spec: PipelineSpec) -> int:
        low, high = 1, 2**40
        while high - low > 1:
            mid = (low + high) // 2
            try:
                costs.split(spec, mid)
                high = mid
            except SplitError:
                low = mid
        return high

    gpipe, one = need(PipelineSpec(4, "gpipe", 8)), need(PipelineSpec(4, "1f1b", 8))
    assert one < gpipe
    plan = plan_pipeline(graph, PipelineSpec(4, "auto", 8, 0), memory=(one + gpipe) // 2)
    weighed = dict(plan.weighed)
    assert weighed[PipelineSpec(4, "gpipe", 8)] is None and plan.spec.schedule != "gpipe"
    assert "no split fits memory: gpipe" in pipeline_line(plan)
    with pytest.raises(PassError, match="pp schedule auto: no schedule splits 8 layers over 4 pipeline ranks"):
        plan_pipeline(graph, PipelineSpec(4, "auto", 8, 0), memory=1)
