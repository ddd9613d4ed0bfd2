"""Started collectives and their waits (``ir.asynchrony``, the verifier) and the ``overlap`` pass."""

from __future__ import annotations

import json

import pytest
import torch

from meshfold import ir
from meshfold.ir import VerifyError
from meshfold.ir.asynchrony import inflight
from meshfold.ir.asynchrony import starts as starts_of
from meshfold.ir.graph import local_nbytes
from meshfold.ir.ops import ALL_REDUCE, RELOAD, WAIT
from meshfold.passes.cost.axis import axis_models
from meshfold.passes.cost.liveness import rank_memory
from meshfold.passes.options import Options
from meshfold.passes.schedule.timeline import Costs, replay, to_chrome_trace
from meshfold.session import compile_model
from meshfold.target.hardware import device_cluster, parse_cluster
from meshfold.tools.zoo import build

HEADER = "graph @g mesh<dp=2> {\n  param %w : f32[64, 64] {dp: S(0)}\n  input %x : f32[32, 64] {dp: S(0)}\n"


def _graph(body: str, outputs: str = "  output out(0) = %y\n") -> ir.Graph:
    return ir.parse(HEADER + body + outputs + "}\n")


GATHER = '  %h = comm.all_gather(%w, axis="dp", dim=0) : f32[64, 64]  # l fwd\n'


def test_a_wait_after_its_start_verifies() -> None:
    g = _graph(
        GATHER + "  %w1 = comm.wait(%h) : f32[64, 64]  # l fwd\n  %y = aten.mm(%x, %w1) : f32[32, 64] {dp: S(0)}\n"
    )
    ir.verify(g)
    assert inflight(g).peak == 64 * 64 * 4


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (  # a compute op reads the handle, not the waited value
            GATHER + "  %w1 = comm.wait(%h) : f32[64, 64]  # l fwd\n  %y = aten.mm(%x, %h) : f32[32, 64] {dp: S(0)}\n",
            "a handle of a started collective",
        ),
        (  # a wait on something that is not a collective
            "  %h = aten.relu(%w) : f32[64, 64] {dp: S(0)}\n  %w1 = comm.wait(%h) : f32[64, 64] {dp: S(0)}\n"
            "  %y = aten.relu(%x) : f32[32, 64] {dp: S(0)}\n",
            "neither an asynchronous collective nor a reload",
        ),
        (  # waited twice
            GATHER + "  %w1 = comm.wait(%h) : f32[64, 64]  # l fwd\n  %w2 = comm.wait(%h) : f32[64, 64]  # l fwd\n"
            "  %y = aten.mm(%x, %w1) : f32[32, 64] {dp: S(0)}\n",
            "waited on twice",
        ),
        (  # started in the forward, waited in the backward
            GATHER + "  %w1 = comm.wait(%h) : f32[64, 64]  # l bwd\n  %y = aten.mm(%x, %w1) : f32[32, 64] {dp: S(0)}\n",
            "belong to one phase",
        ),
        (  # the wait's result changes the layout
            GATHER + "  %w1 = comm.wait(%h) : f32[64, 64] {dp: S(0)}  # l fwd\n"
            "  %y = aten.mm(%x, %w1) : f32[32, 64] {dp: S(0)}\n",
            "type and layout",
        ),
    ],
)
def test_broken_schedules_are_refused_by_name(body: str, message: str) -> None:
    with pytest.raises(VerifyError, match=message):
        ir.verify(_graph(body), check_types=False)


def test_a_handle_cannot_be_an_output() -> None:
    body = GATHER + "  %w1 = comm.wait(%h) : f32[64, 64]  # l fwd\n  %y = aten.mm(%x, %w1) : f32[32, 64] {dp: S(0)}\n"
    with pytest.raises(VerifyError, match="output its wait's result"):
        ir.verify(_graph(body, "  output out(0) = %y\n  output out(1) = %h\n"))


def test_the_bound_on_bytes_in_flight_is_checked() -> None:
    body = (
        GATHER
        + '  %h2 = comm.all_gather(%w, axis="dp", dim=0) : f32[64, 64]  # l fwd\n'
        + "  %a = comm.wait(%h) : f32[64, 64]  # l fwd\n  %b = comm.wait(%h2) : f32[64, 64]  # l fwd\n"
        + "  %c = aten.add.Tensor(%a, %b) : f32[64, 64]\n  %y = aten.mm(%x, %c) : f32[32, 64] {dp: S(0)}\n"
    )
    g = _graph(body)
    ir.verify(g, max_inflight=2 * 64 * 64 * 4)
    with pytest.raises(VerifyError, match="in flight on a rank"):
        ir.verify(g, max_inflight=64 * 64 * 4)


def _llama(
    pipeline: str, mesh: str = "dp=2,tp=2", plan: str = "fsdp+tp", cluster: str | None = None
) -> tuple[ir.Graph, dict[str, object]]:
    model, inputs = build("llama-tiny")
    res = compile_model(model, inputs, Options.of(mesh=mesh, plan=plan, pipeline=pipeline, cluster=cluster))
    return res.graph, dict(res.stats)


BASE = "cleanup,moe-fold,sharding,boxing,bucket"


def _index(graph: ir.Graph) -> dict[ir.Value, int]:
    return {r: k for k, op in enumerate(graph.ops) for r in op.results}


def test_overlap_keeps_the_program_and_hides_communication_by_its_model() -> None:
    # NOTE: on H100s a tiny model's collectives take about as long as its kernels (on gloo ranks a
    # collective's millisecond dwarfs them: nothing to hide them behind)
    plain, _ = _llama(BASE + ",verify", cluster="h100:4x1")
    graph, stats = _llama(BASE + ",overlap,verify", cluster="h100:4x1")
    # NOTE: the same ops, apart from the waits and the start handles
    assert sorted(op.name for op in graph.ops if op.target != WAIT) == sorted(op.name for op in plain.ops)
    waits = [op for op in graph.ops if op.target == WAIT]
    assert len(waits) == sum(
        1 for op in plain.ops if op.name.startswith("comm.") and "shard" not in op.name and "partial" not in op.name
    )
    s = stats["overlap"]
    assert isinstance(s, dict)
    assert s["exposed_s"] < 0.8 * s["exposed_before_s"], s
    assert s["step_s"] < s["step_before_s"], s
    # NOTE: the predicted figures are the replay of the graph that came out
    costs = Costs(graph, axis_models(graph.mesh, parse_cluster("h100:4x1")))  # type: ignore[arg-type]
    assert replay(graph, costs).exposed_total == pytest.approx(s["exposed_s"])


def test_parameter_gathers_start_a_block_ahead_and_wait_before_first_use() -> None:
    graph, _ = _llama(BASE + ",overlap{prefetch=1},verify")
    at = _index(graph)
    users = graph.users()
    for k, op in enumerate(graph.ops):
        if op.target != WAIT:
            continue
        readers = [at[u.results[0]] for r in op.results for u in users.get(r, []) if u.results]
        if readers:
            # NOTE: no computation between a wait and its first reader (other starts and waits may be)
            between = graph.ops[k + 1 : min(readers)]
            assert all(o.name.startswith("comm.") for o in between), (op.describe(), [o.describe() for o in between])
    start = {op.results[0]: k for k, op in enumerate(graph.ops)}
    gathers = [
        op for op in graph.ops if op.name == "comm.wait" and "layers.1" in op.prov.module and op.prov.phase == "fwd"
    ]
    assert gathers, "layers.1's forward gather"
    first_layer0 = min(
        k
        for k, op in enumerate(graph.ops)
        if op.prov.module.startswith("layers.0") and op.target != WAIT and not op.name.startswith("comm.")
    )
    issued = start[gathers[0].operands[0]]
    # NOTE: layers.1's parameters are on the wire while layers.0 computes
    assert issued > first_layer0 and issued < at[gathers[0].results[0]]
    assert any(
        o.prov.module.startswith("layers.0") and not o.name.startswith("comm.")
        for o in graph.ops[issued : at[gathers[0].results[0]]]
    )


def test_prefetch_zero_and_a_small_bound_hold_less_in_flight() -> None:
    wide, _ = _llama(BASE + ",overlap{prefetch=2},verify")
    narrow, stats = _llama(BASE + ",overlap{prefetch=0,max-inflight=8KiB},verify")
    assert inflight(narrow).peak < inflight(wide).peak
    # NOTE: the bound gives way only when nothing else is in flight: one collective at a time then
    assert isinstance(stats["overlap"], dict)
    biggest = max(sum(local_nbytes(r, narrow.mesh) for r in op.results) for op in narrow.ops if op.target == WAIT)
    assert inflight(narrow).peak <= max(8 * 1024, biggest)


def test_gradient_reduce_scatters_are_bucketed_per_block() -> None:
    graph, _ = _llama(BASE + ",overlap,verify", mesh="dp=2", plan="fsdp")
    buckets = [op for op in graph.ops if op.name == "comm.reduce_scatter_bucket"]
    assert {op.prov.module for op in buckets} >= {"layers.0", "layers.1"}, [op.prov.module for op in buckets]


def test_a_gradient_reduced_over_one_axis_then_another_travels_under_the_next_block() -> None:
    """A block's gradients reduced over cp and then dp (``ddp+cp``): the cp bucket is waited, and the dp
    bucket started, after the next block's backward has computed, not on the line after the cp
    bucket starts (where its wait would stall the compute)."""
    graph, stats = _llama(BASE + ",overlap,verify", mesh="dp=2,cp=2", plan="ddp+cp")
    at = {op: k for k, op in enumerate(graph.ops)}
    producers = graph.producers()
    chains = []
    for op in graph.ops:
        if op.name != "comm.all_reduce_bucket" or op.kwarg("axis") != "dp":
            continue
        waits = {producers[v] for v in op.operands if v in producers and producers[v].target == WAIT}
        for wait in waits:
            first = producers[wait.operands[0]]
            if first.name == "comm.all_reduce_bucket":
                chains.append((first, wait, op))
    assert len(chains) >= 2, [op.describe() for op in graph.ops if op.name == "comm.all_reduce_bucket"]
    # NOTE: the last block's chain has no block after it: its dp bucket goes at the phase's end
    for first, wait, second in sorted(chains, key=lambda c: at[c[0]])[:-1]:
        assert first.kwarg("axis") == "cp" and at[first] < at[wait] < at[second]
        between = graph.ops[at[first] + 1 : at[wait]]
        computed = {
            o.prov.module.split(".")[:2] == first.prov.module.split(".")[:2]
            for o in between
            if not o.name.startswith("comm.")
        }
        # NOTE: compute of another block runs while the cp bucket is on the wire
        assert False in computed, (first.describe(), [o.describe() for o in between])
    s = stats["overlap"]
    assert isinstance(s, dict) and s["exposed_s"] < s["exposed_before_s"], s


def test_chrome_trace_of_the_predicted_timeline() -> None:
    graph, _ = _llama(BASE + ",overlap,verify")
    tl = replay(graph, Costs(graph, axis_models(graph.mesh, None)))  # type: ignore[arg-type]
    trace = json.loads(json.dumps(to_chrome_trace(tl)))
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    comm = [e for e in boxes if e["tid"] == 1]
    compute = [e for e in boxes if e["tid"] == 0]
    assert comm and compute
    # NOTE: some collective runs while the compute stream is busy
    assert any(c["ts"] < k["ts"] + k["dur"] and k["ts"] < c["ts"] + c["dur"] for c in comm for k in compute)
    assert max(e["ts"] + e["dur"] for e in boxes) == pytest.approx(1e6 * tl.step, rel=1e-6)
    # NOTE: the pass's statistics replay without events: the same totals
    bare = replay(graph, Costs(graph, axis_models(graph.mesh, None)), events=False)  # type: ignore[arg-type]
    assert not bare.events and (bare.end, bare.comm, bare.exposed) == (tl.end, tl.comm, tl.exposed)


def test_tp_chunks_split_each_partial_gemm_and_its_all_reduce() -> None:
    plain, _ = _llama(BASE + ",overlap,verify")
    graph, _ = _llama(BASE + ",overlap{tp-chunks=2},verify")

    def reduces(g: ir.Graph) -> int:
        return sum(1 for op in g.ops if op.name == "comm.all_reduce" and op.kwarg("axis") == "tp")

    chunked = sum(1 for op in graph.ops if op.name == "aten.cat" and any("_c1" in v.name for v in op.operands))
    assert chunked > 0
    # NOTE: each chunked pair's one all-reduce became two
    assert reduces(graph) == reduces(plain) + chunked
    # NOTE: a chunk's all-reduce is on the wire while the next chunk's GEMM runs
    at = {op: k for k, op in enumerate(graph.ops)}
    waits = starts_of(graph)
    assert any(
        op.name == "aten.mm" and at[s] < at[op] < at[w]
        for w, s in waits.items()
        if s.kwarg("axis") == "tp"
        for op in graph.ops
    )


def _offloaded_llama(cluster: str | None) -> ir.Graph:
    model, inputs = build("llama-tiny")
    return compile_model(
        model, inputs, Options.of(mesh="dp=2,tp=2", plan="fsdp+tp", memory="offload", cluster=cluster)
    ).graph


def test_reloads_start_just_in_time_on_a_copy_engine() -> None:
    """Offloaded activations on H100s: each ``mem.reload`` is started (a ``comm.wait`` on it right
    before its first reader) early enough that the time model's copy stream ends it before that
    reader, so no wait on it holds the compute stream, and no earlier (the predicted peak is that of
    reloading in place). On gloo ranks (no copy engine: the core copies) each stays in place."""
    graph, local = _offloaded_llama("h100:4x1"), _offloaded_llama(None)
    at = _index(graph)
    reloads = [k for k, op in enumerate(graph.ops) if op.target == RELOAD]
    waits = {s: w for w, s in starts_of(graph).items()}
    assert reloads and all(graph.ops[k] in waits for k in reloads)
    users = graph.users()
    for k in reloads:
        done = at[waits[graph.ops[k]].results[0]]
        first = min(at[u.results[0]] for r in waits[graph.ops[k]].results for u in users[r] if u.results)
        assert all(o.name.startswith("comm.") or o.target == RELOAD for o in graph.ops[done + 1 : first])
    assert not any(s.target == RELOAD for s in starts_of(local).values())
    assert sum(1 for op in local.ops if op.target == RELOAD) == len(reloads)
    h100 = axis_models(graph.mesh, parse_cluster("h100:4x1"))  # type: ignore[arg-type]
    held = {}
    for name, g in (("started", graph), ("in place", local)):
        tl = replay(g, Costs(g, h100))
        copies = sum(e.seconds for e in tl.events if e.stream == "copy" and e.phase == "bwd")
        held[name] = sum(e.seconds for e in tl.events if e.stream == "wait" and "reload" in e.name)
    assert copies > 0 and held["started"] == 0.0 and held["in place"] == pytest.approx(copies), (copies, held)
    assert rank_memory(graph).peak <= rank_memory(_reloaded_in_place(graph)).peak


def _reloaded_in_place(graph: ir.Graph) -> ir.Graph:
    """``graph`` with each started reload moved to right before its wait (every other op where it was)."""
    waits = {s: w for w, s in starts_of(graph).items() if s.target == RELOAD}
    b = ir.GraphBuilder.like(graph)
    started = {w: s for s, w in waits.items()}
    for op in graph.ops:
        if op in waits:
            continue
        if op in started:
            b.append(started[op])
        b.append(op)
    for o in graph.outputs:
        b.add_output(o.kind, o.name, o.value)
    out = b.build()
    ir.verify(out)
    return out


@pytest.mark.parametrize(
    ("name", "per_node", "ranks", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 8, 16, ("h100", 8, 2)),
        ("NVIDIA A100-SXM4-80GB", 8, 4, ("a100", 4, 1)),
        ("NVIDIA H200", 4, 6, ("h200", 4, 2)),
        ("NVIDIA GeForce RTX 4090", 1, 1, None),
    ],
)
def test_a_cuda_mesh_is_planned_for_the_part_its_driver_names(
    name: str, per_node: int, ranks: int, expected: tuple[str, int, int] | None
) -> None:
    c = device_cluster(name, per_node, ranks)
    assert (c.device.name, c.devices_per_node, c.nodes) == expected if c else expected is None


# NOTE: a sequence-parallel projection: the partial GEMM result reduce-scattered on its rows
SCATTER = """graph @g mesh<tp=2> {
  param %w : f32[8, 12] {tp: S(0)}
  input %x : f32[16, 8] {tp: S(1)}
  %y = aten.mm(%x, %w) : f32[16, 12] {tp: P(sum)}  # mlp.down fwd
  %r = comm.reduce_scatter(%y, axis="tp", dim=DIM, reduce="sum") : f32[16, 12] {tp: S(DIM)}  # mlp.down fwd
  output out(0) = %r
}
"""


def test_tp_chunks_split_a_gemm_whose_rows_are_reduce_scattered() -> None:
    from meshfold.backends.interpret import run_values
    from meshfold.passes.schedule.chunks import chunk_matmuls

    g = ir.parse(SCATTER.replace("DIM", "0"))
    out = chunk_matmuls(g, 3)
    ir.verify(out)
    scatters = [op for op in out.ops if op.name == "comm.reduce_scatter"]
    assert len(scatters) == 3 and all(op.kwarg("dim") == 0 for op in scatters)
    assert [tuple(op.result.type.shape) for op in scatters] == [(16, 4)] * 3
    # NOTE: every chunk keeps the rows split as the whole was; the cat puts the columns back
    assert all(op.result.layout == g.ops[1].result.layout for op in scatters)
    assert out.ops[-1].name == "aten.cat" and out.ops[-1].result == g.ops[1].result
    feeds = {"w": torch.randn(8, 12), "x": torch.randn(16, 8)}
    want, got = run_values(g, feeds, global_view=True), run_values(out, feeds, global_view=True)
    torch.testing.assert_close(got[out.outputs[0].value], want[g.outputs[0].value])
    # NOTE: scattered on the columns themselves: left whole
    cols = ir.parse(SCATTER.replace("DIM", "1"))
    assert [op.name for op in chunk_matmuls(cols, 3).ops] == [op.name for op in cols.ops]


def test_random_ops_keep_their_order_through_the_schedule() -> None:
    """Dropout draws from the program's one generator in program order: a parallel-residual block's two
    dropouts (independent branches the scheduler may otherwise interleave around ring attention's
    collectives) keep the order they were captured in, so each draws the single-device model's mask."""
    from meshfold.ir.ops import draws
    from meshfold.tools.corpus import entries as corpus_entries

    net, inputs = corpus_entries.get("gen-0-3").build()  # NOTE: parallel residual, dropout on both branches
    opts = Options.of(mesh=ir.Mesh(("dp", "cp"), (2, 2)), plan="fsdp+cp", cp={"method": "ring"})
    result = compile_model(net, inputs, opts)
    captured = [op.prov.module for op in result.captured.ops if draws(op)]
    compiled = [op.prov.module for op in result.graph.ops if draws(op)]
    assert len(captured) == 8 and compiled == captured, compiled


# NOTE: tests/ir_corpus/mm_i64_in_sharded_graph.ir with its operand f32 (a valid program): sharding moves
# the output to R by a dp all-reduce tagged ``fwd`` (every ``out`` output's move is) of %y, which the
# backward computes
MM_IN_THE_BACKWARD = """\
graph @g mesh<dp=2, tp=2> {
  input %x : f32[4, 8] {dp: S(0)}
  input %w : f32[8, 16] {tp: S(1)}
  %h = aten.neg(%x) : f32[4, 8] {dp: S(0)}  # layers.0.mlp fwd
  %y = aten.mm(%h, %w) : f32[4, 16] {dp: S(0), tp: S(1)}  # layers.0.mlp bwd
  output out(0) = %y
}
"""


def test_a_forward_op_reading_what_the_backward_made_is_scheduled_after_it() -> None:
    """The default pipeline up to ``overlap`` on a graph whose output's forward-tagged all-reduce reads a
    backward value: the all-reduce is started after the GEMM that makes its operand (it was started at
    the forward's beginning, before %y existed, and the printer crashed on the result); the program
    verifies and its text reads back as itself."""
    from meshfold.passes.options import DEFAULT_PIPELINE

    g = ir.parse(MM_IN_THE_BACKWARD)
    pipeline = DEFAULT_PIPELINE.removesuffix(",verify")
    assert pipeline.endswith("overlap")
    out = compile_model(g, options=Options.of(mesh=g.mesh, pipeline=pipeline)).graph
    ir.verify(out)  # NOTE: every operand defined before the op that reads it, every wait after its start
    text = str(out)
    assert str(ir.parse(text)) == text
    unscheduled = compile_model(g, options=Options.of(mesh=g.mesh, pipeline=pipeline.removesuffix(",overlap")))
    assert sorted(op.name for op in out.ops if op.target != WAIT) == sorted(op.name for op in unscheduled.graph.ops)
    (reduce,) = (op for op in out.ops if op.name == "comm.all_reduce")
    assert reduce.prov.phase == "fwd" and [v.name for v in reduce.operands] == ["y"]


def test_readers_of_a_forward_op_that_reads_the_backward_follow_it() -> None:
    """A boxed graph scheduled alone: a forward-tagged all-reduce of a backward GEMM's partial sum, and a
    forward-tagged relu of what it brings, both go after the GEMM (the backward section takes every
    reader of its values, and their readers in turn)."""
    from meshfold.passes.sharding.boxing import BOXED
    from meshfold.passes.sharding.propagate import SHARDED

    g = ir.parse(
        "graph @g mesh<dp=2> {\n"
        "  input %x : f32[32, 64] {dp: S(1)}\n"
        "  param %w : f32[64, 64] {dp: S(0)}\n"
        "  %h = aten.neg(%x) : f32[32, 64] {dp: S(1)}  # l fwd\n"
        "  %p = aten.mm(%h, %w) : f32[32, 64] {dp: P(sum)}  # l bwd\n"
        '  %r = comm.all_reduce(%p, axis="dp", reduce="sum") : f32[32, 64]  # <root> fwd\n'
        "  %y = aten.relu(%r) : f32[32, 64]  # <root> fwd\n"
        "  output out(0) = %y\n"
        "}\n"
    )
    out = compile_model(g, options=Options.of(pipeline="overlap"), assume=frozenset({SHARDED, BOXED})).graph
    ir.verify(out)
    assert [op.name for op in out.ops] == ["aten.neg", "aten.mm", "comm.all_reduce", "comm.wait", "aten.relu"]
    assert str(ir.parse(str(out))) == str(out)


def test_a_start_before_its_operand_is_made_is_refused_by_name() -> None:
    """What the scheduler wrote before the fix (an all-reduce started before the GEMM that makes its
    operand): the verifier names the op and the value, and the printer refuses it with the value's
    name (no lookup error from inside it)."""
    g = ir.parse(MM_IN_THE_BACKWARD)
    neg, mm = g.ops
    b = ir.GraphBuilder.like(g)
    reduced = ir.Value("y_1", mm.result.type, ir.Layout.replicated(g.mesh))  # type: ignore[arg-type]
    handle = ir.Value("y_start", reduced.type, reduced.layout)
    b.append(neg)
    b.append(ir.Op(ALL_REDUCE, (mm.result,), (("axis", "dp"), ("reduce", "sum")), (handle,), ir.Provenance()))
    b.append(mm)
    b.append(ir.Op(WAIT, (handle,), (), (reduced,), ir.Provenance()))
    b.add_output("out", "0", reduced)
    bad = b.build()
    with pytest.raises(VerifyError, match=r"comm\.all_reduce at <root> \(fwd\): operand %y is not defined before"):
        ir.verify(bad, check_types=False)
    with pytest.raises(ValueError, match="value %y is used before it is defined"):
        str(bad)
    # NOTE: pass-debug asked to print it says so as a CLI error, naming the op and the value
    from meshfold.tools.common import CliError
    from meshfold.tools.pass_debug import _print_ir

    with pytest.raises(CliError, match=r"after pass 3 .*comm\.all_reduce at <root> \(fwd\): operand %y"):
        _print_ir("IR after pass 3 of 9 (overlap)", bad)
