"""``cp={"method": ...}``: how the sharding solve lets attention read a sequence split over a ``cp``
mesh axis, and what lowering makes of a sequence-split attention (no ranks needed; the rank tests
are tests/dist/test_context_parallel.py)."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from meshfold import DEFAULT_PIPELINE, CompileResult, Options, capture, compile_model, ir
from meshfold.backends.context_parallel.ring_lowering import kernel_backward, kernel_forward
from meshfold.backends.eager import RankContext, lower
from meshfold.ir.dialects.ring import RANK_ARG, RING_STEP, RING_STEP_BACKWARD, first_step
from meshfold.ir.ops import PPERMUTE
from meshfold.passes import PassError
from meshfold.passes.cp import CpSpec
from meshfold.passes.sharding.ilp.problem import solve_report
from meshfold.tools.zoo import build


@cache
def _one_long_sequence() -> ir.Graph:
    """llama-tiny (4 query heads over 2 of keys and values, the kernel called causal) on one sequence of 32."""
    net, _ = build("llama-tiny")
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    return capture(net, (ids, ids.clone()))


def _compiled(method: str, mesh: str = "cp=4", pipeline: str | None = None) -> CompileResult:
    """``pipeline="kernel"``: without ``ring-steps`` (a sequence-split attention runs as one kernel)."""
    steps = DEFAULT_PIPELINE if pipeline is None else DEFAULT_PIPELINE.replace("ring-steps,", "")
    options = Options.of(mesh=mesh, plan="cp", cp={"method": method}, pipeline=steps)
    return compile_model(_one_long_sequence(), None, options)


def _queries(graph: ir.Graph) -> list[str]:
    """The layout of each forward attention's queries (ring attention written as steps: its first)."""
    fwd = [op for op in graph.ops if ("scaled_dot_product" in op.name or first_step(op)) and op.prov.phase == "fwd"]
    return [str(op.operands[0].layout) for op in fwd]


def test_cp_spec_reads_every_form_and_refuses_unknown_ones() -> None:
    assert CpSpec.of(None) == CpSpec("auto") == CpSpec.of({})
    assert CpSpec.of("ring") == CpSpec.of({"method": "ring"}) == CpSpec("ring")
    with pytest.raises(PassError, match="cp method 'tokenring!' is unknown; use one of auto, ring, tokenring, ulysses"):
        CpSpec.of({"method": "tokenring!"})
    with pytest.raises(PassError, match="cp= takes the key 'method'; unknown: degree"):
        CpSpec.of({"degree": 2})
    with pytest.raises(PassError, match="cp= says how attention reads a sequence split over a cp mesh axis"):
        Options.of(mesh="tp=2", plan="tp", cp="ring")


@pytest.mark.parametrize(
    ("method", "split", "report"),
    [
        ("ring", "{cp: S(2)}", "2 by sequence (ring attention)"),
        ("tokenring", "{cp: S(2)}", "2 by sequence (TokenRing)"),
        ("ulysses", "{cp: S(1)}", "2 by heads (Ulysses)"),
    ],
)
def test_the_method_decides_how_every_attention_reads_the_split_sequence(method: str, split: str, report: str) -> None:
    """``ring`` and ``tokenring``: queries, keys and values stay split along the sequence (dim 2 of
    ``[B, H, S, D]``), so no all-to-all moves them; ``ulysses``: an all-to-all splits them by heads
    instead. The plan report says which."""
    result = _compiled(method)
    lines = solve_report(result.stats)
    assert f"context parallel on 'cp': attention split {report}" in lines, lines
    steps = [line for line in lines if " as 4 steps each" in line]
    # NOTE: the kernel is called causal with no mask tensor: ring attention and TokenRing are written as steps
    want = {
        "ring": [
            "context parallel on 'cp': 2 ring attentions as 4 steps each, their keys and values passed by "
            "comm.ppermute ops the overlap pass schedules"
        ],
        "tokenring": [
            "context parallel on 'cp': 2 TokenRing attentions as 4 steps each, their queries and results "
            "passed by comm.ppermute ops the overlap pass schedules"
        ],
    }
    assert steps == want.get(method, []), lines
    graph = result.graph
    assert {str(i.value.layout) for i in graph.inputs if i.kind == "input"} == {"{cp: S(1)}"}
    queries = _queries(graph)
    assert queries and set(queries) == {split}, queries
    to_heads = [op for op in graph.ops if op.name == "comm.all_to_all" and op.kwarg("split_dim") == 1]
    assert bool(to_heads) == (method == "ulysses")


def test_a_sequence_split_attention_lowers_to_ring_attention_over_the_cp_group() -> None:
    """Lowering calls the ring kernels (forward and backward, with the cp axis's process group and the
    method) for each attention whose queries are split along the sequence and that runs as one op
    (TokenRing), the plain kernel otherwise; ring attention written as its steps calls each step
    with this rank's coordinate on the axis, and each ``comm.ppermute`` is one all-to-all over the
    cp group."""
    for method, pipeline in (("ring", None), ("tokenring", None), ("tokenring", "kernel"), ("ulysses", None)):
        graph = _compiled(method, "cp=2", pipeline).graph
        assert graph.mesh is not None
        run = "tokenring" if method == "tokenring" else "ring"
        lowered = lower(graph, RankContext(graph.mesh, (1,), ("cp-group",), cp_method=run))
        calls = [n for m in (lowered.forward, lowered.backward) for n in m.graph.nodes if n.op == "call_function"]
        rings = [n for n in calls if n.target in (kernel_forward, kernel_backward)]
        attention = [op for op in graph.ops if "scaled_dot_product" in op.name]
        kernel = pipeline == "kernel"
        assert len(rings) == (len(attention) if kernel else 0) and bool(attention) == (kernel or method == "ulysses")
        assert all(n.args[:2] == ("cp-group", run) for n in rings)
        steps = [n for n in calls if n.target in (RING_STEP, RING_STEP_BACKWARD)]
        permutes = [op for op in graph.ops if op.target == PPERMUTE]
        exchanges = [n for n in calls if n.target == torch.ops._c10d_functional.all_to_all_single.default]
        assert bool(steps) == (method != "ulysses" and not kernel)
        assert all(n.args[RANK_ARG[n.target]] == 1 for n in steps)  # NOTE: the IR holds -1 (every rank's part)
        assert len([n for n in exchanges if n.args[3] == "cp-group"]) >= len(permutes)


def test_ring_refuses_an_attention_it_cannot_split_by_name() -> None:
    """A kernel that applies dropout has no ring form (its mask is drawn for the whole sequence):
    ``ring`` names the op and its module path and says what to use instead. (On CPU, dropout sends
    ``scaled_dot_product_attention`` down its math path, so the kernel call is written into the IR.)"""
    text = ir.print_graph(_one_long_sequence())
    kernel = "%_unsafe_view_4, 0.0, True)"
    assert text.count(kernel) == 1
    graph = ir.parse(text.replace(kernel, "%_unsafe_view_4, 0.1, True)"))
    options = Options.of(mesh="cp=2", plan="cp", cp="ring")
    with pytest.raises(PassError, match=r"scaled_dot_product.* at layers\.0\.self_attn .*dropout.*'ulysses'"):
        compile_model(graph, None, options)


def test_ulysses_refuses_heads_the_axis_does_not_divide_by_name() -> None:
    """Ulysses splits attention by heads (or batch): 4 query heads and one sequence over 8 ranks leave it
    no split, and the compile says so, naming the op, before the solve runs."""
    want = r"scaled_dot_product.* at layers\.0\.self_attn .*4 heads and batch of 1 .*8 ranks"
    with pytest.raises(PassError, match=want):
        _compiled("ulysses", mesh="cp=8")


def test_tokenring_is_priced_by_what_it_sends() -> None:
    """The ring strategy's traffic is the keys and values round the ring (their gradients too, backward);
    under TokenRing it is the queries out and the results back: forward the queries, output and
    log-sum-exp, backward those with the output's gradient and the queries' gradient."""
    from meshfold.passes import cp
    from meshfold.passes.sharding.cost import nbytes
    from meshfold.passes.sharding.rules.attention import RING_KERNELS, ring_strategy

    graph = _one_long_sequence()
    fwd, bwd = (next(op for op in graph.ops if op.target == k) for k in RING_KERNELS)
    size = {name: nbytes(v.type) for name, v in zip("qkv", fwd.operands[:3], strict=True)}
    out, lse = (nbytes(r.type) for r in fwd.results[:2])
    ring_fwd, ring_bwd = ring_strategy(fwd), ring_strategy(bwd)
    assert ring_fwd is not None and ring_bwd is not None
    assert ring_fwd.passed == size["k"] + size["v"] and ring_bwd.passed == 2 * (size["k"] + size["v"])
    assert cp.priced(fwd, ring_fwd, "ring") == ring_fwd
    assert cp.priced(fwd, ring_fwd, "tokenring").passed == size["q"] + out + lse
    assert cp.priced(bwd, ring_bwd, "tokenring").passed == 2 * size["q"] + 2 * out + lse


@pytest.mark.hf
def test_the_solve_keeps_a_long_sequence_split_through_convolutions_and_scans() -> None:
    """hf-mamba's model on one sequence of 256 under plan="cp" on 4 ranks: the solve itself (no greedy
    choice) splits each layer's causal convolution and selective scan along the sequence, forward
    and backward, and the split lowers to the halo exchange and the scan that passes composite
    steps; at 128 tokens replicating them is the cheaper plan for so small a model."""
    from meshfold.backends.context_parallel.halo import causal_conv1d_backward_split, causal_conv1d_split
    from meshfold.backends.context_parallel.split_scans import affine_scan_backward_split, affine_scan_split
    from meshfold.tools.bench.recurrences import build as mamba

    net, inputs = mamba(256, 32)
    result = compile_model(capture(net, inputs), None, Options.of(mesh="cp=4", plan="cp"))
    graph = result.graph
    assert list(solve_report(result.stats)[-2:]) == [
        "context parallel on 'cp': causal convolutions 2 by sequence",
        "context parallel on 'cp': recurrences 2 by sequence",
    ]
    placed = {
        (op.name, op.prov.phase, str(op.operands[int(op.prov.phase == "bwd" and "conv" in op.name)].layout))
        for op in graph.ops
        if op.name.startswith(("meshfold.affine_scan", "meshfold.causal_conv1d"))
    }
    assert placed == {
        ("meshfold.affine_scan", "fwd", "{cp: S(1)}"),
        ("meshfold.affine_scan_backward", "bwd", "{cp: S(1)}"),
        ("meshfold.causal_conv1d", "fwd", "{cp: S(2)}"),
        ("meshfold.causal_conv1d_backward", "bwd", "{cp: S(2)}"),
    }, placed
    assert graph.mesh is not None
    lowered = lower(graph, RankContext(graph.mesh, (1,), ("cp-group",)))
    called = {n.target for m in (lowered.forward, lowered.backward) for n in m.graph.nodes}
    assert {causal_conv1d_split, affine_scan_split, causal_conv1d_backward_split, affine_scan_backward_split} <= called


@pytest.mark.hf
def test_a_convolution_split_finer_than_its_reach_is_refused_when_lowered() -> None:
    """hf-mamba's model on one sequence of 8 over cp=4 with the greedy choice: its convolutions (filters
    of 4) split by sequence would leave each rank 2 positions, fewer than the 3 a position reads back,
    so lowering refuses, naming the op and what to do (on every rank alike, before the program runs)."""
    from meshfold.tools.bench.recurrences import build as mamba

    net, inputs = mamba(8, 32)
    greedy = DEFAULT_PIPELINE.replace("sharding", "sharding{mode=greedy}")
    options = Options.of(mesh="cp=4", plan="cp", pipeline=greedy)
    graph = compile_model(capture(net, inputs), None, options).graph
    assert graph.mesh is not None
    refusal = r"causal_conv1d at backbone.layers.0.mixer .*holds 2 positions.*back \(3\); use fewer ranks on cp"
    with pytest.raises(ValueError, match=refusal):
        lower(graph, RankContext(graph.mesh, (1,), ("cp-group",)))
