"""The routed-experts op against a token-by-token reference, its registration, and how ``moe=``
specs map onto meshes (and are refused, naming the rule)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from meshfold import ir
from meshfold.ir.dialects.moe import EXPERTS, experts, experts_range
from meshfold.passes import PassError
from meshfold.passes.moe.spec import expert_overrides
from meshfold.tools.zoo import build
from meshfold.tracing.moe_layers import ExpertsSite, MoeSpec, find_experts

T, H, INTER, E, K = 12, 8, 6, 4, 2


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    return hidden, idx, weights, torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)


def _reference(hidden, idx, weights, gate_up, down):  # type: ignore[no-untyped-def]
    rows = []
    for t in range(T):
        acc = torch.zeros(H)
        for j in range(K):
            e = int(idx[t, j])
            g, u = (gate_up[e] @ hidden[t]).chunk(2)
            acc = acc + weights[t, j] * (down[e] @ (F.silu(g) * u))
        rows.append(acc)
    return torch.stack(rows)


def test_op_equals_token_by_token_reference_with_gradients() -> None:
    _equals_reference(_inputs())


def _equals_reference(inputs: tuple[torch.Tensor, ...]) -> None:
    """The op and the token-by-token reference agree in output and every gradient."""
    args = [a.requires_grad_(a.is_floating_point()) for a in inputs]
    got, want = experts(*args), _reference(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    seed = torch.randn(T, H)
    diff = [args[0], args[2], args[3], args[4]]
    for a, b in zip(torch.autograd.grad(got, diff, seed), torch.autograd.grad(want, diff, seed), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_expert_shares_sum_to_the_whole() -> None:
    hidden, idx, weights, gate_up, down = _inputs(1)
    whole = experts(hidden, idx, weights, gate_up, down)
    gu = gate_up.view(E, 2, INTER, H)
    halves = [experts_range(lo, hidden, idx, weights, gu[lo : lo + 2], down[lo : lo + 2], "silu") for lo in (0, 2)]
    torch.testing.assert_close(halves[0] + halves[1], whole)
    assert not torch.equal(halves[0], whole)


def test_intermediate_shares_sum_to_the_whole() -> None:
    # NOTE: expert tensor parallelism: each rank holds a slice of every expert's intermediate dim,
    # its gate and up rows together ([E, 2, I, H] split on I) and the matching down columns
    hidden, idx, weights, gate_up, down = _inputs(4)
    whole = experts(hidden, idx, weights, gate_up, down)
    gu = gate_up.view(E, 2, INTER, H)
    parts = [
        experts_range(0, hidden, idx, weights, gu[:, :, s], down[:, :, s], "silu")
        for s in (slice(0, INTER // 2), slice(INTER // 2, INTER))
    ]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(parts[0], whole)


def test_op_is_registered_for_capture() -> None:
    hidden, idx, weights, gate_up, down = _inputs(2)
    args = (hidden, idx, weights, gate_up.view(E, 2, INTER, H), down, "silu", 0, "probs", "any")
    result = torch.library.opcheck(EXPERTS, args)
    assert set(result.values()) == {"SUCCESS"}, result


def _share(fn: Any, lo: int, options: tuple[Any, ...], **kw: Any) -> Any:
    """``fn`` (a ranged local form) on experts ``[lo, lo + 2)``, its tensors as the arguments."""
    if fn.__name__.endswith("backward_ranged"):
        return lambda dy, h, i, w, g, d: fn(lo, 2, dy, h, i, w, g, d, *options, **kw)
    return lambda h, i, w, g, d: fn(lo, 2, h, i, w, g, d, *options, **kw)


def test_one_ranks_share_traces_as_one_op_for_compilers() -> None:
    """The local form of experts sharded over ranks (``backends.local``) traces with fake tensors,
    as Inductor traces a rank's program: its grouping of tokens by expert has data-dependent shapes
    (nonzero), so it runs as the ops ``moe_experts_range`` and its backward; traced and run, it is
    ``experts_range``'s share exactly, and each share's gradients sum to the whole's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from meshfold.backends.experts.ranged import EXPERTS_RANGE, EXPERTS_RANGE_BACKWARD
    from meshfold.backends.local import moe_experts_backward_ranged, moe_experts_ranged
    from meshfold.ir.dialects.moe import experts_range_backward

    hidden, idx, weights, gate_up, down = _inputs(5)
    gu = gate_up.view(E, 2, INTER, H)
    grad = torch.randn(T, H)
    options = ("silu", 0, "probs", "any")
    whole = experts_range_backward(0, grad, hidden, idx, weights, gu, down, *options)
    summed = [torch.zeros_like(t) for t in whole[:2]]
    for lo in (0, 2):
        mine = (gu[lo : lo + 2], down[lo : lo + 2])

        traced = make_fx(_share(moe_experts_ranged, lo, options), tracing_mode="fake")(hidden, idx, weights, *mine)
        back = _share(moe_experts_backward_ranged, lo, options, rows=3)
        traced_back = make_fx(back, tracing_mode="fake")(grad, hidden, idx, weights, *mine)
        assert {n.target for n in traced.graph.nodes if n.op == "call_function"} == {EXPERTS_RANGE}
        assert {n.target for n in traced_back.graph.nodes if n.op == "call_function"} >= {EXPERTS_RANGE_BACKWARD}
        torch.testing.assert_close(
            traced(hidden, idx, weights, *mine), experts_range(lo, hidden, idx, weights, *mine, "silu")
        )
        got = traced_back(grad, hidden, idx, weights, *mine)
        torch.testing.assert_close(got[2], whole[2][lo : lo + 2])
        torch.testing.assert_close(got[3], whole[3][lo : lo + 2])
        summed = [a + b for a, b in zip(summed, got[:2], strict=True)]
    for a, b in zip(summed, whole[:2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    args = (2, hidden, idx, weights, gu[2:], down[2:], *options)
    for op, call in ((EXPERTS_RANGE, args), (EXPERTS_RANGE_BACKWARD, (args[0], grad, *args[1:]))):
        result = torch.library.opcheck(op, call, test_utils=("test_schema", "test_faketensor"))
        assert set(result.values()) == {"SUCCESS"}, result


def test_hf_experts_are_found_and_modulelist_experts_are_left_to_the_graph() -> None:
    pytest.importorskip("transformers")
    model, _ = build("hf-mixtral")
    sites, notes = find_experts(model)
    assert [s.path for s in sites] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert {s.act for s in sites} == {"silu"} and {s.num_experts for s in sites} == {4}
    assert notes == []
    # NOTE: ModuleList experts are folded (or warned about) on dynamo's graph: tests/unit/test_moe_lists.py
    tiny, _ = build("mixtral-list-tiny")
    assert find_experts(tiny) == ([], [])


MESH = ir.Mesh.parse("dp=2,tp=2")
SITE = [ExpertsSite("m.experts", "m.experts.gate_up_proj", "m.experts.down_proj", "silu", 4, 6)]


@pytest.mark.parametrize(
    ("spec", "expect"),
    [
        ({"ep": 4}, {"dp": "S(0)", "tp": "S(0)"}),
        ({"ep": 2}, {"tp": "S(0)", "dp": "R"}),
        ({"ep": 1}, {"dp": "R", "tp": "R"}),
    ],
)
def test_ep_maps_onto_the_innermost_axes(spec: dict[str, int], expect: dict[str, str]) -> None:
    out = expert_overrides(MoeSpec.of(spec), SITE, MESH)
    assert out == {"m.experts.gate_up_proj": expect, "m.experts.down_proj": expect}


def test_etp_takes_the_innermost_axis_and_splits_the_intermediate_dim() -> None:
    out = expert_overrides(MoeSpec.of({"ep": 2, "etp": 2}), SITE, MESH)
    assert out["m.experts.down_proj"] == {"tp": "S(2)", "dp": "S(0)"}
    assert out["m.experts.gate_up_proj"] == {"tp": "R", "dp": "S(0)"}
    # NOTE: a gate/up weight stored as [E, 2, I, H] (stacked from an nn.ModuleList) is split on I too
    stacked = [dataclasses.replace(SITE[0], gate_up_rank=4)]
    out = expert_overrides(MoeSpec.of({"ep": 2, "etp": 2}), stacked, MESH)
    assert out["m.experts.gate_up_proj"] == {"tp": "S(2)", "dp": "S(0)"}
    odd = [ExpertsSite("m.experts", "a", "b", "silu", 4, 5)]
    with pytest.raises(PassError, match="intermediate % etp must be 0"):
        expert_overrides(MoeSpec.of({"ep": 2, "etp": 2}), odd, MESH)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"ep": 3}, "no such run of axes has 3 ranks"),
        ({"ep": 8}, "no such run of axes has 8 ranks"),
        ({"ep": 4, "etp": 2}, "no such run of axes has 4 ranks"),
        ({"ep": 2, "hierarchical": True, "dispatcher": "allgather"}, "form of the all-to-all dispatcher"),
        ({"ep": 2, "capacity_factor": 0.0}, "positive factor"),
        ({"ep": 2, "drop_policy": "random"}, "drop_policy"),
        ({"ep": 2, "pad_to_capacity": True}, "pad_to_capacity needs a capacity_factor"),
        ({"ep": 2, "bogus": 1}, "unknown keys"),
        ({"ep": 2, "dispatcher": "teleport"}, "use one of"),
    ],
)
def test_invalid_mappings_are_refused_naming_the_rule(spec: dict[str, object], message: str) -> None:
    with pytest.raises(PassError, match=message):
        expert_overrides(MoeSpec.of(spec), SITE, MESH)


def test_expert_count_must_divide_by_ep() -> None:
    three = [ExpertsSite("m.experts", "a", "b", "silu", 6, 6)]
    with pytest.raises(PassError, match="num_experts % ep must be 0"):
        expert_overrides(MoeSpec.of({"ep": 4}), three, MESH)


def test_moe_without_foldable_experts_is_refused() -> None:
    with pytest.raises(PassError, match="no MoE layer meshfold can fold"):
        expert_overrides(MoeSpec.of({"ep": 2}), [], MESH)


def test_an_activation_named_nowhere_is_read_off_the_function() -> None:
    from torch import nn

    from meshfold.tracing.moe_layers import _act_of

    assert _act_of(torch.nn.functional.silu) == "silu"
    assert _act_of(nn.GELU(approximate="tanh")) == "gelu_tanh" and _act_of(nn.GELU()) == "gelu"
    assert _act_of(torch.tanh) is None and _act_of(None) is None


def test_pieces_of_an_expert_equal_the_reference() -> None:
    """The op asked to compute 3 pairs at a time (``rows=3``, as the memory pass asks it, so every
    expert here takes several pieces and the weight gradients sum over them): forward and every
    gradient, through the backward op the autograd formula calls, as the token-by-token reference."""
    hidden, idx, weights, gate_up, down = (a.requires_grad_(a.is_floating_point()) for a in _inputs(1))
    gu = gate_up.view(E, 2, INTER, H)
    got = torch.ops.meshfold.moe_experts(hidden, idx, weights, gu, down, "silu", 0, "probs", "any", rows=3)
    want = _reference(hidden, idx, weights, gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    seed = torch.randn(T, H)
    diff = [hidden, weights, gate_up, down]
    for a, b in zip(torch.autograd.grad(got, diff, seed), torch.autograd.grad(want, diff, seed), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "n", "k", "rows"),
    [(4096, 64, 96, 4, 2, 512), (4096, 64, 96, 4, 2, 64), (1024, 256, 128, 8, 4, 512)],
)
def test_working_set_is_what_the_allocator_holds(
    tokens: int, hidden: int, inter: int, n: int, k: int, rows: int
) -> None:
    """``ir.dialects.moe_memory.working_set`` plus the op's results against the CPU allocator's own peak while the
    forward and the backward op run (more pairs per expert than ``rows``, so in pieces): within 1%."""
    from meshfold.ir.dialects.moe import EXPERTS_BACKWARD, experts_range_backward, with_rows
    from meshfold.ir.dialects.moe_memory import working_set
    from meshfold.ir.graph import local_nbytes
    from meshfold.tools.measure import peak_new_bytes

    grads = f"f32[{tokens}, {hidden}], f32[{tokens}, {k}], f32[{n}, 2, {inter}, {hidden}], f32[{n}, {hidden}, {inter}]"
    text = f"""graph @moe {{
  param %gu : f32[{n}, 2, {inter}, {hidden}]
  param %wd : f32[{n}, {hidden}, {inter}]
  input %x : f32[{tokens}, {hidden}]
  input %idx : i64[{tokens}, {k}]
  input %w : f32[{tokens}, {k}]
  input %gy : f32[{tokens}, {hidden}]
  %e = meshfold.moe_experts(%x, %idx, %w, %gu, %wd, "silu", 0, "probs", "any") : f32[{tokens}, {hidden}]  # moe fwd
  %b.0, %b.1, %b.2, %b.3 = meshfold.moe_experts_backward(%gy, %x, %idx, %w, %gu, %wd, "silu", 0, "probs", "any") \
: {grads}  # moe bwd
  output out(0) = %e
}}
"""
    graph = ir.parse(text)
    mesh = ir.Mesh.of(dp=1)
    g = torch.Generator().manual_seed(0)
    x, gy = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, hidden, generator=g)
    w, idx = torch.randn(tokens, n, generator=g).softmax(-1).topk(k)
    gu, wd = torch.randn(n, 2, inter, hidden, generator=g), torch.randn(n, hidden, inter, generator=g)
    measured = [
        peak_new_bytes(lambda: experts_range(0, x, idx, w, gu, wd, "silu", rows=rows)),
        peak_new_bytes(lambda: experts_range_backward(0, gy, x, idx, w, gu, wd, "silu", rows=rows)),
    ]
    ops = [with_rows(op, rows) for op in graph.ops if op.target in (EXPERTS, EXPERTS_BACKWARD)]
    for op, got in zip(ops, measured, strict=True):
        want = working_set(op, mesh) + sum(local_nbytes(r, mesh) for r in op.results)
        assert abs(want - got) <= 0.01 * got, (op.describe(), want, got)
