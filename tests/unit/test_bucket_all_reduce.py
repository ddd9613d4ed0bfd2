"""``bucket`` merges a block's gradient all-reduces into one ``comm.all_reduce_bucket``, also where a
gradient is all-reduced over one axis and then another, and never where a reader would come first."""

from __future__ import annotations

from meshfold import ir
from meshfold.passes.context import PassContext
from meshfold.passes.options import Options
from meshfold.passes.schedule.bucket import Bucket
from meshfold.session import compile_model
from meshfold.tools.zoo import build

# NOTE: two parameters' gradients, partial over both axes, reduced over tp and then dp
CHAIN = """graph @g mesh<dp=2, tp=2> {
  input %g0 : f32[16, 8] {dp: P(sum), tp: P(sum)}
  input %g1 : f32[8] {dp: P(sum), tp: P(sum)}
  %a0 = comm.all_reduce(%g0, axis="tp", reduce="sum") : f32[16, 8] {dp: P(sum)}  # layers.0.q bwd
  %b0 = comm.all_reduce(%a0, axis="dp", reduce="avg") : f32[16, 8]  # layers.0.q bwd
  %a1 = comm.all_reduce(%g1, axis="tp", reduce="sum") : f32[8] {dp: P(sum)}  # layers.0.norm bwd
  %b1 = comm.all_reduce(%a1, axis="dp", reduce="avg") : f32[8]  # layers.0.norm bwd
  output out(0) = %b0
  output out(1) = %b1
}
"""


def _bucketed(text: str) -> ir.Graph:
    g = ir.parse(text)
    out = Bucket().apply(PassContext(mesh=g.mesh), g)
    ir.verify(out)
    return out


def test_a_chain_over_two_axes_becomes_two_buckets_in_order() -> None:
    g = _bucketed(CHAIN)
    assert [(op.name, op.kwarg("axis"), op.kwarg("reduce")) for op in g.ops] == [
        ("comm.all_reduce_bucket", "tp", "sum"),
        ("comm.all_reduce_bucket", "dp", "avg"),
    ]
    tp, dp = g.ops
    # NOTE: the dp bucket reads what the tp bucket made, operand for operand
    assert dp.operands == tp.results
    assert [o.value for o in g.outputs] == list(dp.results)
    # NOTE: the new op prints and parses back to the same text (pass-debug's dumps, golden files)
    text = ir.print_graph(g)
    assert ir.print_graph(ir.parse(text)) == text
    assert 'comm.all_reduce_bucket(%a0, %a1, axis="dp", reduce="avg")' in text, text


def test_a_reader_before_the_bucket_keeps_its_all_reduces_apart() -> None:
    # NOTE: the dp all-reduces differ in their reduction, so each stays where it is, and %b0 reads %a0
    # before %a1, where a tp bucket would be placed
    old = 'comm.all_reduce(%a1, axis="dp", reduce="avg")'
    assert CHAIN.count(old) == 1
    g = _bucketed(CHAIN.replace(old, 'comm.all_reduce(%a1, axis="dp", reduce="sum")'))
    assert [op.name for op in g.ops] == ["comm.all_reduce"] * 4


def test_an_all_reduce_read_by_computation_stays_where_it_is() -> None:
    used = CHAIN.replace(
        "  output out(0) = %b0\n", "  %c = aten.relu(%b0) : f32[16, 8]  # head fwd\n  output out(0) = %c\n"
    )
    g = _bucketed(used)
    # NOTE: %b0 is read by a computation: not a gradient on its way out, and neither is %a0 then
    assert [op.name for op in g.ops].count("comm.all_reduce") == 4


def test_data_parallel_gradients_are_bucketed_per_block() -> None:
    model, inputs = build("llama-tiny")
    opts = Options.of(mesh="dp=2", plan="ddp", pipeline="cleanup,moe-fold,sharding,boxing,bucket,verify")
    g = compile_model(model, inputs, opts).graph
    buckets = [op for op in g.ops if op.name == "comm.all_reduce_bucket"]
    assert {op.prov.module for op in buckets} >= {"layers.0", "layers.1"}, [op.prov.module for op in buckets]
    assert all(len(op.operands) > 1 and op.kwarg("axis") == "dp" for op in buckets)
    left = [op.describe() for op in g.ops if op.name == "comm.all_reduce" and op.prov.phase == "bwd"]
    # NOTE: every gradient is in a bucket, the norm weights' too (summed as [1, 1, d], viewed as [d])
    assert not left, left


# NOTE: a norm weight's gradient summed as [1, 1, 8], reduce-scattered on its last dim and viewed as
# [8], beside a weight matrix's
VIEWED = """graph @g mesh<dp=2> {
  input %g0 : f32[1, 1, 8] {dp: P(sum)}
  input %g1 : f32[8, 8] {dp: P(sum)}
  %s0 = comm.reduce_scatter(%g0, axis="dp", dim=2, reduce="sum") : f32[1, 1, 8] {dp: S(2)}  # layers.0.norm bwd
  %v0 = aten.view(%s0, [8]) : f32[8] {dp: S(0)}  # layers.0.norm bwd
  %h = aten.relu(%g1) : f32[8, 8] {dp: P(sum)}  # layers.0.fc bwd
  %s1 = comm.reduce_scatter(%h, axis="dp", dim=0, reduce="sum") : f32[8, 8] {dp: S(0)}  # layers.0.fc bwd
  output out(0) = %v0
  output out(1) = %s1
}
"""


def test_a_view_on_the_way_out_moves_after_its_bucket() -> None:
    g = _bucketed(VIEWED)
    assert [op.name for op in g.ops] == ["aten.relu", "comm.reduce_scatter_bucket", "aten.view"]
    bucket, view = g.ops[1:]
    assert view.operands[0] is bucket.results[0]
    # NOTE: the view read by a computation stays, and so does its reduce-scatter
    used = VIEWED.replace(
        "  output out(0) = %v0\n", "  %w = aten.neg(%v0) : f32[8] {dp: S(0)}  # m bwd\n  output out(0) = %w\n"
    )
    assert "comm.reduce_scatter_bucket" not in [op.name for op in _bucketed(used).ops]
