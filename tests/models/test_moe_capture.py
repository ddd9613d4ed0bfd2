"""MoE forms: DeepSeek-V3 routing checked token by token against plain Python, deepseek-tiny's golden
dump, the zoo's stacked experts against ``meshfold.moe_experts`` and against the ``nn.ModuleList`` form,
the data-dependent per-expert loop (the same model as mixtral-list-tiny), and transformers' Mixtral
with its default experts implementation — captured graphs run op by op against eager."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from meshfold import capture, ir
from meshfold.ir.dialects.moe import EXPERTS, experts
from meshfold.tools.zoo import build
from meshfold.tools.zoo.models import MoeExpert, StackedExperts
from meshfold.tools.zoo.moe_zoo import GroupLimitedRouter, moe_loop_tiny, sequence_balance_loss
from meshfold.tracing.moe_layers import find_experts
from tests.golden import test_golden_zoo as golden_zoo
from tests.models.test_capture import assert_graph_matches_eager


def _assert_graph_matches_eager(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Capture ``model``; the graph, interpreted, gives the eager loss and every gradient."""
    assert_graph_matches_eager(capture(model, inputs), model, inputs)


def _route_one_token(router: GroupLimitedRouter, x: torch.Tensor) -> dict[int, float]:
    """DeepSeek-V3 routing of one token in plain Python: chosen expert -> weight."""
    scores = torch.sigmoid(router.weight @ x).tolist()
    biased = [s + b for s, b in zip(scores, router.e_score_correction_bias.tolist(), strict=True)]
    size = len(scores) // router.n_group
    groups = [list(range(g * size, (g + 1) * size)) for g in range(router.n_group)]
    group_score = [sum(sorted((biased[e] for e in grp), reverse=True)[:2]) for grp in groups]
    kept = sorted(range(router.n_group), key=lambda g: group_score[g], reverse=True)[: router.topk_group]
    candidates = [e for g in kept for e in groups[g]]
    chosen = sorted(candidates, key=lambda e: biased[e], reverse=True)[: router.top_k]
    total = sum(scores[e] for e in chosen)
    return {e: router.scale * scores[e] / total for e in chosen}


@pytest.mark.parametrize(
    ("n_group", "topk_group", "top_k", "boost"),
    [(2, 1, 3, None), (4, 2, 3, None), (4, 2, 2, 5), (1, 1, 2, None)],
    ids=["2groups-keep1", "4groups-keep2", "bias-boosts-expert5", "one-group"],
)
def test_group_limited_router_matches_per_token_reference(
    n_group: int, topk_group: int, top_k: int, boost: int | None
) -> None:
    torch.manual_seed(0)
    router = GroupLimitedRouter(16, 8, top_k, n_group, topk_group, scale=2.5)
    if boost is not None:
        # NOTE: a large bias must put the expert in every selection but never change a weight.
        router.e_score_correction_bias[boost] = 10.0
    flat = torch.randn(32, 16)
    with torch.no_grad():
        top_i, top_w, _ = router(flat)
    for t in range(flat.size(0)):
        want = _route_one_token(router, flat[t])
        got = dict(zip(top_i[t].tolist(), top_w[t].tolist(), strict=True))
        assert set(got) == set(want), f"token {t}"
        for e, w in want.items():
            assert got[e] == pytest.approx(w, rel=1e-5), f"token {t} expert {e}"
        if boost is not None:
            assert boost in got


def test_sequence_balance_loss_matches_per_sequence_reference() -> None:
    g = torch.Generator().manual_seed(0)
    b, t, e, k = 2, 6, 8, 3
    scores = torch.rand(b, t, e, generator=g)
    top_i = scores.topk(k, dim=-1).indices
    per_seq = []
    for s in range(b):
        counts = [sum(int(c in top_i[s, j].tolist()) for j in range(t)) for c in range(e)]
        probs = [sum(float(scores[s, j, c] / scores[s, j].sum()) for j in range(t)) / t for c in range(e)]
        per_seq.append(sum(e / (k * t) * counts[c] * probs[c] for c in range(e)))
    assert float(sequence_balance_loss(scores, top_i)) == pytest.approx(sum(per_seq) / b, rel=1e-5)


def test_deepseek_tiny_after_cleanup_matches_golden_and_eager() -> None:
    golden_zoo.test_zoo_after_cleanup_matches_golden_and_eager("deepseek-tiny")


def _routing(tokens: int, hidden: int, n_experts: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random ``hidden [T, H]``, distinct expert ids ``[T, k]`` and weights ``[T, k]`` (float ones need grad)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(tokens)])
    return x, idx, torch.rand(tokens, k, generator=g, requires_grad=True)


@pytest.mark.parametrize(("n_experts", "k"), [(4, 2), (8, 3), (3, 1)])
def test_stacked_experts_compute_the_experts_op_with_gradients(n_experts: int, k: int) -> None:
    torch.manual_seed(0)
    module = StackedExperts(n_experts, 16, 12)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)  # NOTE: O(1) activations, so a wrong gate/up split shows well above 1e-5
    x, idx, w = _routing(24, 16, n_experts, k, seed=n_experts)
    got = module(x, idx, w)
    want = experts(x, idx, w, module.gate_up_proj, module.down_proj, "silu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    seed = torch.randn_like(got)
    wrt = [x, w, module.gate_up_proj, module.down_proj]
    got_grads = torch.autograd.grad(got, wrt, seed)
    want_grads = torch.autograd.grad(want, wrt, seed)
    for name, a, b in zip(("hidden", "weights", "gate_up_proj", "down_proj"), got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"d {n}: {m}")


def test_stacked_experts_are_found_as_foldable() -> None:
    for name, paths in [
        ("mixtral-tiny", ["layers.0.block_sparse_moe.experts", "layers.1.block_sparse_moe.experts"]),
        ("deepseek-tiny", ["layers.1.mlp.experts", "layers.2.mlp.experts"]),
    ]:
        sites, notes = find_experts(build(name)[0])
        assert [s.path for s in sites] == paths and notes == []
        assert {s.act for s in sites} == {"silu"}


def test_stacked_block_computes_what_the_list_block_computes() -> None:
    stacked, inputs = build("mixtral-tiny")
    listed, _ = build("mixtral-list-tiny")
    by_name = dict(stacked.named_parameters())
    with torch.no_grad():
        for name, p in listed.named_parameters():
            if ".experts." not in name:
                by_name[name].copy_(p)
        for i, layer in enumerate(listed.layers):
            mlps: list[MoeExpert] = list(layer.block_sparse_moe.experts)
            prefix = f"layers.{i}.block_sparse_moe.experts."
            by_name[prefix + "gate_up_proj"].copy_(torch.stack([torch.cat((m.w1.weight, m.w3.weight)) for m in mlps]))
            by_name[prefix + "down_proj"].copy_(torch.stack([m.w2.weight for m in mlps]))
    torch.testing.assert_close(stacked(*inputs), listed(*inputs), rtol=1e-5, atol=1e-6)


def test_loop_form_computes_what_the_dense_form_computes() -> None:
    loop, inputs = moe_loop_tiny()
    dense, _ = build("mixtral-list-tiny")
    assert [n for n, _ in loop.named_parameters()] == [n for n, _ in dense.named_parameters()]
    loop_loss, dense_loss = loop(*inputs), dense(*inputs)
    torch.testing.assert_close(loop_loss, dense_loss)
    loop_loss.backward()
    dense_loss.backward()
    grads = dict(dense.named_parameters())
    for name, p in loop.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("form", ["moe-loop-tiny", "mixtral-list-tiny"])
def test_modulelist_experts_fold_into_one_op_per_layer_and_match_eager(form: str) -> None:
    """The data-dependent loop (which could not be traced to a backward at all unfolded) and the
    dense stack both become one experts op per layer on stacked weights, and give eager's numbers."""
    model, inputs = build(form)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = capture(model, inputs)
    assert sum(op.target == EXPERTS for op in g.ops) == 2
    assert not any(w in str(op.target) for op in g.ops for w in ("nonzero", "index_add", "index_put"))
    assert [s.name for s in g.stacks] == [
        f"layers.{i}.block_sparse_moe.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")
    ]
    # NOTE: w1 is the gate (under silu) and w3 the up projection in MoeExpert: read off the wiring.
    prefix = "layers.0.block_sparse_moe.experts"
    assert g.stacks[0].members[1] == (f"{prefix}.1.w1.weight", f"{prefix}.1.w3.weight")
    assert g.stacks[1].members[3] == (f"{prefix}.3.w2.weight",)
    assert ir.parse(str(g)).stacks == g.stacks
    assert_graph_matches_eager(g, model, inputs)


class _LossOf(nn.Module):
    """A transformers causal LM whose forward returns its training loss (the LM itself keeps its class)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels, use_cache=False).loss


@pytest.mark.hf
def test_hf_mixtral_default_experts_capture_as_one_experts_op() -> None:
    pytest.importorskip("transformers")
    import copy

    from transformers import MixtralForCausalLM
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    zoo_model, inputs = build("hf-mixtral")
    config = copy.deepcopy(zoo_model.config)
    config._experts_implementation = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lm = MixtralForCausalLM(config)
    # NOTE: the default is resolved from the class's own module source; a subclass defined in another
    # module (the zoo's loss wrapper) falls back to the eager loop instead.
    assert lm.config._experts_implementation == "grouped_mm"
    maybe_install_capturing_hooks(lm.model)
    model = _LossOf(lm)
    g = capture(model, inputs)
    # NOTE: whichever kernel transformers would pick (its own grouped-mm op under dynamo with fp32
    # weights), capture folds the experts module into one meshfold op per layer and direction.
    names = [op.name for op in g.ops]
    assert names.count("meshfold.moe_experts") == 2 and names.count("meshfold.moe_experts_backward") == 2
    assert "transformers" not in {getattr(op.target, "namespace", "") for op in g.ops}
    _assert_graph_matches_eager(model, inputs)
