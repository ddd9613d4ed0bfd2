"""Nano-batching a sequence-parallel region (``passes/schedule/nano.py``, ``overlap{nano-batches=k}``)."""

from __future__ import annotations

import pytest
import torch

from meshfold import ir
from meshfold.backends.interpret import run_values
from meshfold.ir.asynchrony import starts
from meshfold.passes.context import PassContext
from meshfold.passes.schedule.nano import nano_batch
from meshfold.passes.schedule.overlap import Overlap

# NOTE: an MLP on tokens sharded over tp on the batch dim: gathered, three GEMMs, reduce-scattered;
# the gathered input and the gate's activation are kept for later (outputs), as a backward keeps them.
MLP = """graph @g mesh<dp=2, tp=2> {
  param %wg : f32[8, 12] {tp: S(1)}
  param %wd : f32[12, 8] {tp: S(0)}
  input %x : f32[8, 6, 8] {dp: S(0), tp: S(0)}
  %h = comm.all_gather(%x, axis="tp", dim=0) : f32[8, 6, 8] {dp: S(0)}  # mlp fwd
  %f = aten.view(%h, [48, 8]) : f32[48, 8] {dp: S(0)}  # mlp fwd
  %a = aten.mm(%f, %wg) : f32[48, 12] {dp: S(0), tp: S(1)}  # mlp fwd
  %a3 = aten._unsafe_view(%a, [8, 6, 12]) : f32[8, 6, 12] {dp: S(0), tp: S(2)}  # mlp fwd
  %s = aten.silu(%a3) : f32[8, 6, 12] {dp: S(0), tp: S(2)}  # mlp fwd
  %m = aten.mul.Tensor(%s, %a3) : f32[8, 6, 12] {dp: S(0), tp: S(2)}  # mlp fwd
  %mf = aten.view(%m, [48, 12]) : f32[48, 12] {dp: S(0), tp: S(1)}  # mlp fwd
  %d = aten.mm(%mf, %wd) : f32[48, 8] {dp: S(0), tp: P(sum)}  # mlp fwd
  %r = comm.reduce_scatter(%d, axis="tp", dim=0, reduce="sum") : f32[48, 8] {dp: S(0), tp: S(0)}  # mlp fwd
  %y = aten.relu(%r) : f32[48, 8] {dp: S(0), tp: S(0)}  # out fwd
  output out(0) = %y
  output out(1) = %f
  output out(2) = %s
}
"""


def _run(g: ir.Graph) -> list[torch.Tensor]:
    feeds = {"wg": torch.randn(8, 12, generator=_gen()), "wd": torch.randn(12, 8, generator=_gen()), "x": _x()}
    env = run_values(g, feeds, global_view=True)
    return [env[o.value] for o in g.outputs]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _x() -> torch.Tensor:
    return torch.randn(8, 6, 8, generator=_gen())


@pytest.mark.parametrize("k", [2, 3])
def test_a_sequence_parallel_mlp_runs_as_nano_batches_of_tokens(k: int) -> None:
    g = ir.parse(MLP)
    out = nano_batch(g, k)
    ir.verify(out)
    gathers = [op for op in out.ops if op.name == "comm.all_gather"]
    scatters = [op for op in out.ops if op.name == "comm.reduce_scatter"]
    # NOTE: each nano-batch is a slice of the other token dim (the sequence), gathered on the batch
    assert len(gathers) == len(scatters) == k
    assert [tuple(op.result.type.shape) for op in gathers] == [(8, 6 // k, 8)] * k
    assert all(op.kwarg("dim") == 0 and op.result.layout == g.ops[0].result.layout for op in gathers)
    assert [tuple(op.result.type.shape) for op in scatters] == [(48 // k, 8)] * k
    assert sum(op.name == "aten.mm" for op in out.ops) == 2 * k
    # NOTE: what is read outside the region is made again whole, under its own name and layout
    assert [o.value for o in out.outputs] == [o.value for o in g.outputs]
    for want, got in zip(_run(g), _run(out), strict=True):
        torch.testing.assert_close(got, want)


def test_the_scheduler_runs_one_nano_batch_collective_under_the_other_gemms() -> None:
    g = ir.parse(MLP)
    out = Overlap(nano_batches=2).apply(PassContext(mesh=g.mesh), g)
    ir.verify(out)
    at = {op: n for n, op in enumerate(out.ops)}
    mms = [at[op] for op in out.ops if op.name == "aten.mm"]
    gathers = sorted((at[s], at[w]) for w, s in starts(out).items() if s.name == "comm.all_gather")
    # NOTE: both nano-batches' gathers start before any GEMM; the second is waited after the first's GEMMs
    assert len(gathers) == 2 and gathers[1][0] < mms[0]
    assert sum(1 for m in mms if m < gathers[1][1]) == 2
    # NOTE: the first reduce-scatter is on the wire while the second nano-batch's down GEMM runs
    rs = sorted((at[s], at[w]) for w, s in starts(out).items() if s.name == "comm.reduce_scatter")
    assert any(rs[0][0] < m < rs[0][1] for m in mms)
    for want, got in zip(_run(g), _run(out), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("edit", "k", "why"),
    [
        (("{dp: S(0), tp: S(0)}\n  %h", "{dp: S(1), tp: S(0)}\n  %h"), 2, "a mesh axis shards the sequence"),
        (("", ""), 4, "the sequence (6) does not split into 4"),
        (("aten.silu(%a3)", "aten._softmax(%a3, 1, False)"), 2, "an op mixes tokens: the region stops before it"),
    ],
)
def test_a_region_that_cannot_split_is_left_whole_or_stops(edit: tuple[str, str], k: int, why: str) -> None:
    g = ir.parse(MLP.replace(*edit))
    out = nano_batch(g, k)
    ir.verify(out)
    gathers = sum(op.name == "comm.all_gather" for op in out.ops)
    if "mixes" in why:
        # NOTE: the gather and the gate GEMM still split; the rest runs whole on the put-together activation
        assert gathers == 2 and sum(op.name == "comm.reduce_scatter" for op in out.ops) == 1, why
        for want, got in zip(_run(g), _run(out), strict=True):
            torch.testing.assert_close(got, want)
    else:
        assert [op.name for op in out.ops] == [op.name for op in g.ops], why


def test_nano_batches_and_column_chunks_compose() -> None:
    """``tp-chunks`` runs after nano-batching: each nano-batch's down GEMM is split again into column
    chunks, each reduce-scattered on its own; the program still computes the same values."""
    g = ir.parse(MLP)
    out = Overlap(nano_batches=2, tp_chunks=2).apply(PassContext(mesh=g.mesh), g)
    ir.verify(out)
    scatters = [op for op in out.ops if op.name == "comm.reduce_scatter"]
    assert len(scatters) == 4 and {tuple(op.result.type.shape) for op in scatters} == {(24, 4)}
    for want, got in zip(_run(g), _run(out), strict=True):
        torch.testing.assert_close(got, want)
