"""The ``memory`` pass: recompute in the backward (``passes.memory``), its policies and budgets."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from meshfold import ir
from meshfold.passes.base import PassError
from meshfold.passes.context import PassContext
from meshfold.passes.cost.liveness import rank_memory
from meshfold.passes.memory.activations import Memory
from meshfold.passes.memory.offload import offloaded, saved_activations
from meshfold.passes.memory.policies import policy_values
from meshfold.passes.memory.recompute import recompute
from meshfold.passes.options import Options
from meshfold.passes.pipeline import PassPipeline
from meshfold.session import compile_model
from meshfold.tools.zoo import build

BLOCKS = Path(__file__).parents[1] / "golden" / "memory" / "full-blocks.ir"


def _blocks() -> ir.Graph:
    """Two FSDP blocks (``layers.0``, ``layers.1``): gather, GEMM, gelu, gather, GEMM each."""
    text = "\n".join(ln for ln in BLOCKS.read_text().splitlines() if not ln.startswith("//"))
    return ir.parse(text)


def _saved(g: ir.Graph) -> set[str]:
    """Names of the forward values the backward reads (what the forward hands to the backward)."""
    fwd = {r for op in g.ops if op.prov.phase == "fwd" for r in op.results}
    return {v.name for op in g.ops if op.prov.phase == "bwd" for v in op.operands if v in fwd}


def test_a_block_is_recomputed_from_its_input() -> None:
    g = _blocks()
    values = policy_values(g, "full")
    assert {v.name for v in values["layers.0"]} == {"w01", "w01t", "h0", "a0", "w02", "w02t"}  # %y0: read by layers.1
    assert _saved(g) == {"h0", "a0", "y0", "h1", "a1"}
    out = recompute(g, values["layers.0"] | values["layers.1"])
    ir.verify(out)
    assert _saved(out) == {"y0"}  # NOTE: %x is an input, handed over as it is
    # NOTE: each recomputed op runs once, before the backward's first reader, and the backward's own
    # gather of a weight the recompute gathers again is that one
    again = [op for op in out.ops if op.prov.phase == "bwd" and op.result.name.endswith("_rc")]
    names = ["w11_rc", "w11t_rc", "h1_rc", "a1_rc", "w01_rc", "w01t_rc", "h0_rc", "a0_rc"]
    assert [op.result.name for op in again] == names
    assert "w11b" not in {r.name for op in out.ops for r in op.results}
    before, after = rank_memory(g), rank_memory(out)
    assert after.peak_transient < before.peak_transient


def test_only_pure_non_output_forward_values_are_recomputed() -> None:
    g = _blocks()
    y1 = next(op.result for op in g.ops if op.result.name == "y1")
    with pytest.raises(ValueError, match="cannot be recomputed"):
        recompute(g, {y1})
    dropped = ir.parse(
        "graph @d mesh<dp=2> {\n  input %x : f32[8, 32] {dp: S(0)}\n  tangent %dy : f32[8, 32] {dp: S(0)}\n"
        "  %m = aten.bernoulli.p(%x, 0.5) : f32[8, 32] {dp: S(0)}  # layers.0.drop fwd\n"
        "  %y = aten.mul.Tensor(%x, %m) : f32[8, 32] {dp: S(0)}  # layers.0.drop fwd\n"
        "  %z = aten.relu(%y) : f32[8, 32] {dp: S(0)}  # layers.0.act fwd\n"
        "  %dz = aten.threshold_backward(%dy, %z, 0) : f32[8, 32] {dp: S(0)}  # layers.0.act bwd\n"
        "  %dx = aten.mul.Tensor(%dz, %m) : f32[8, 32] {dp: S(0)}  # layers.0.drop bwd\n"
        "  output out(0) = %z\n  output out(1) = %dx\n}\n"
    )
    values = policy_values(dropped, "full")
    assert {v.name for v in values["layers.0"]} == {"y"}  # NOTE: the mask is a draw: kept, never drawn twice
    out = Memory(policy="full").apply(PassContext(mesh=dropped.mesh), dropped)
    assert _saved(out) == {"m", "z"}


def test_a_budget_recomputes_the_fewest_blocks_that_fit() -> None:
    g = _blocks()
    keep = rank_memory(g)
    full = rank_memory(recompute(g, set().union(*policy_values(g, "full").values())))
    peak = keep.peak
    low = full.peak
    assert Memory(budget=peak).apply(PassContext(mesh=g.mesh), g) is g
    ctx = PassContext(mesh=g.mesh)
    out = Memory(budget=low).apply(ctx, g)
    stats = ctx.stats["memory"]
    assert isinstance(stats, dict) and stats["peak_after"] <= low < stats["peak_before"] == peak
    assert len(stats["recomputed"]) >= 1 and stats["recompute_s"] > 0
    assert any(op.result.name.endswith("_rc") for op in out.ops)


def test_budgets_that_cannot_be_met_fail_naming_the_bytes() -> None:
    g = _blocks()
    keep = rank_memory(g)
    with pytest.raises(PassError, match=r"below the parameter state alone .*largest parameter on a rank: l0\.w1"):
        Memory(budget=keep.resident // 2).apply(PassContext(mesh=g.mesh), g)
    with pytest.raises(PassError, match="with every block recomputed or offloaded the predicted peak is"):
        Memory(budget=keep.resident + 64).apply(PassContext(mesh=g.mesh), g)
    with pytest.raises(PassError, match="under policy keep"):
        Memory(policy="keep", budget=keep.resident + 64).apply(PassContext(mesh=g.mesh), g)


def test_the_pass_runs_before_overlap() -> None:
    g = _blocks()
    scheduled = PassPipeline.parse("overlap").run(PassContext(mesh=g.mesh), g, initial=frozenset({"boxed"}))[0]
    with pytest.raises(PassError, match="before overlap"):
        Memory(policy="full").apply(PassContext(mesh=g.mesh), scheduled)


def test_memory_full_from_the_front_door() -> None:
    """``memory="full"`` is a policy, not a size; a misspelt one names what it takes."""
    assert Options.of(memory="full").memory_policy == "full"
    assert Options.of(memory="6GiB").memory == 6 * 2**30
    with pytest.raises(PassError, match="full"):
        Options.of(memory="fulll")
    net, inputs = build("llama-tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = compile_model(net, inputs, Options.of(mesh="dp=2,tp=2", plan="fsdp+tp", memory="full"))
    stats = result.stats["memory"]
    assert isinstance(stats, dict) and stats["policy"] == "full"
    assert stats["recomputed"] == ["layers.0", "layers.1"]
    assert stats["peak_after"] < stats["peak_before"]


def test_selective_and_kv_recompute_parts_of_the_attention() -> None:
    """``selective``: only what the attention module itself computes (not its projections); ``kv``:
    only the K/V projections and what the attention computes from them alone."""
    net, inputs = build("llama-tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = compile_model(net, inputs, Options.of(mesh="dp=2,tp=2", pipeline="cleanup,sharding,boxing")).graph
    made = {r: op for op in g.ops for r in op.results}
    selective = set().union(*policy_values(g, "selective").values())
    kv = set().union(*policy_values(g, "kv").values())
    assert selective and kv
    assert {made[v].prov.module.split(".", 2)[-1] for v in selective} == {"self_attn"}
    assert any("scaled_dot_product" in made[v].name for v in selective)
    kv_modules = {made[v].prov.module.split(".", 2)[-1] for v in kv}
    assert kv_modules == {"self_attn", "self_attn.k_proj", "self_attn.v_proj"}, kv_modules
    assert not any("scaled_dot_product" in made[v].name or "q_proj" in made[v].prov.module for v in kv)
    full = set().union(*policy_values(g, "full").values())
    assert selective < full and kv < full
    for policy in ("selective", "kv"):
        ctx = PassContext(mesh=g.mesh)
        out = Memory(policy=policy).apply(ctx, g)
        stats = ctx.stats["memory"]
        assert isinstance(stats, dict) and stats["peak_after"] < stats["peak_before"], (policy, stats)
        assert len(_saved(out)) != len(_saved(g))


def test_offload_moves_saved_activations_to_the_host_tier_and_back() -> None:
    """``offload``: each saved activation leaves after its last forward reader and comes back before
    its first backward reader; the forward hands the backward only host copies (0 bytes here)."""
    g = _blocks()
    out = offloaded(g, saved_activations(g, min_bytes=0))
    ir.verify(out)
    assert _saved(out) == {f"{v}_host" for v in ("h0", "a0", "y0", "h1", "a1")}
    names = [op.result.name for op in out.ops]
    for v in ("h0", "a0", "y0", "h1", "a1"):
        host, back = names.index(f"{v}_host"), names.index(f"{v}_reloaded")
        assert out.ops[host].target == ir.ops.OFFLOAD and out.ops[back].target == ir.ops.RELOAD
        readers = [k for k, op in enumerate(out.ops) if v in {u.name for u in op.operands}]
        assert all(out.ops[k].prov.phase == "fwd" and k < host for k in readers if k != host)
        assert f"{v}_reloaded" in {u.name for u in out.ops[back + 1].operands}
    assert rank_memory(out).peak_transient < rank_memory(g).peak_transient
    net, inputs = build("llama-tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = compile_model(net, inputs, Options.of(mesh="dp=2,tp=2", plan="fsdp+tp", memory="offload"))
    stats = result.stats["memory"]
    assert isinstance(stats, dict) and stats["offloaded"] and stats["peak_after"] < stats["peak_before"]


def test_ops_reading_a_buffer_the_step_updates_are_not_recomputed() -> None:
    """BatchNorm reads the running statistics it updates: run again in the backward it would read the
    updated ones (and the step's in-place update of the buffer would invalidate what autograd saved),
    so under ``memory="full"`` its output is kept; the step's buffer updates stay the forward's."""
    from meshfold.tools.corpus import entries as corpus_entries

    net, inputs = corpus_entries.get("script-resnet-bn").build()
    opts = Options.of(mesh=ir.Mesh(("dp",), (2,)), plan="ddp", memory="full")
    graph = compile_model(net, inputs, opts).graph
    buffers = {i.value for i in graph.inputs if i.kind == "buffer"}
    assert any(op.prov.phase == "bwd" and op.prov.module for op in graph.ops if op.name.endswith("convolution"))
    assert not [op.describe() for op in graph.ops if op.prov.phase == "bwd" and buffers & set(op.operands)]
    made = {r: op for op in graph.ops for r in op.results}
    updates = [o for o in graph.outputs if o.kind == "update"]
    assert updates and all(made[o.value].prov.phase == "fwd" for o in updates if o.value in made)
