"""Pipeline stages: the split rule (``passes.stages``), the pipeline options, and a captured program cut
into stage programs (``meshfold.stages``). The multi-rank equivalence is in tests/dist/test_pipeline.py."""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from itertools import combinations, pairwise

import pytest
import torch
from torch import nn

from meshfold.ir.stage import STAGE_IN, STAGE_IN_GRAD
from meshfold.passes import PassError
from meshfold.passes.stages import SplitError, even_split, split_layers
from meshfold.session import CompileOptions, compile_model
from meshfold.stages import Layers, PipelineSpec, split_program, stage_graphs
from meshfold.tied import tied_parameters
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
    opts = CompileOptions.of(mesh="pp=2,dp=2", plan="pp+fsdp", pp={"schedule": "1f1b", "microbatches": 4})
    assert opts.mesh is not None and opts.mesh.names == ("dp",) and opts.pp == PipelineSpec(2, "1f1b", 4, 1)
    assert opts.plan is not None and opts.plan.preset == "fsdp"
    alone = CompileOptions.of(mesh="pp=4", pp={"schedule": "interleaved", "microbatches": 8})
    assert alone.mesh is not None and alone.mesh.names == ("dp",) and alone.mesh.sizes == (1,)
    assert alone.pp is not None and alone.pp.stages == 8 and alone.pp.held(1) == [1, 5]
    with pytest.raises(PassError, match="axis named 'pp'"):
        CompileOptions.of(mesh="dp=2", plan="pp+fsdp")
    with pytest.raises(PassError, match="multiple of 4"):
        CompileOptions.of(mesh="pp=4", pp={"schedule": "interleaved", "microbatches": 6})
    with pytest.raises(PassError, match="not one of"):
        CompileOptions.of(mesh="pp=2", pp={"schedule": "zigzag"})
    with pytest.raises(PassError, match="only the interleaved"):
        CompileOptions.of(mesh="pp=2", pp={"schedule": "1f1b", "virtual": 2})


def _llama(layers: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model, inputs = build("llama-tiny")
    model.layers = nn.ModuleList(DecoderLayer(64, 128, 0, True) for _ in range(layers))
    model.apply(_small_init)
    return model, inputs


def _compiled(model: nn.Module, inputs: tuple[torch.Tensor, ...], stages: int) -> object:
    opts = CompileOptions.of(mesh=f"pp={stages},dp=1", plan="pp+ddp", pp={"microbatches": stages})
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
    assert result.stats["pp.split"] == split  # type: ignore[attr-defined]
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
