"""Zoo entries with mixture-of-experts layers beyond mixtral-tiny: the classic sparse loop over
``nn.ModuleList`` experts and a DeepSeek-V3-style model (sigmoid, group-limited routing with a
selection bias, shared expert, fine-grained stacked routed experts, dense first layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# NOTE: ``register`` adds an entry to the zoo's registry (``shared``); zoo/__init__ imports this module
from meshfold.tools.zoo.models import (
    LlamaAttention,
    LlamaMLP,
    MixtralListTiny,
    RMSNorm,
    Rotary,
    SparseMoeBlock,
    StackedExperts,
)
from meshfold.tools.zoo.shared import _seeded, _shifted_ce, _small_init, _token_inputs, register


class LoopMoeBlock(nn.Module):
    """Sparse MoE the classic eager way: per expert, gather its tokens (``torch.where``), run, ``index_add_``.

    Takes over the router and experts of a :class:`SparseMoeBlock`, so FQNs and weights stay the same.
    NOTE: the number of tokens routed to an expert depends on the data, so shapes are data-dependent;
    capture folds the loop into one experts op (``meshfold.rewrites.moe_lists``), which leaves none.
    """

    def __init__(self, dense: SparseMoeBlock) -> None:
        super().__init__()
        self.num_experts, self.top_k = dense.num_experts, dense.top_k
        self.gate, self.experts = dense.gate, dense.experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        router_logits = self.gate(flat)
        top_w, top_i = torch.topk(F.softmax(router_logits.float(), dim=-1), self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx, pos = torch.where(top_i == e)
            out.index_add_(0, idx, expert(flat[idx]) * top_w[idx, pos, None])
        return out.reshape(b, t, h), router_logits


class MoeLoopTiny(MixtralListTiny):
    """mixtral-list-tiny with its MoE blocks run as the data-dependent per-expert loop (same weights, same loss)."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers:
            layer.block_sparse_moe = LoopMoeBlock(layer.block_sparse_moe)


@register("moe-loop-tiny")
def moe_loop_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """mixtral-list-tiny as a sparse per-expert loop (``torch.where`` + ``index_add``) on ``(input_ids, labels)``."""
    return _seeded(MoeLoopTiny), _token_inputs(256)


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3 routing: sigmoid affinities; a bias-corrected copy picks groups, then experts.

    Groups are ranked by the sum of their two best biased scores and the best ``topk_group`` kept;
    the ``top_k`` best experts of the kept groups are chosen. ``e_score_correction_bias`` is a buffer
    (balanced outside autograd) that steers selection only: the weights are the chosen unbiased
    scores, normalized to sum 1 and multiplied by ``scale``.
    """

    e_score_correction_bias: torch.Tensor

    def __init__(self, hidden: int, n_experts: int, top_k: int, n_group: int, topk_group: int, scale: float) -> None:
        super().__init__()
        self.top_k, self.n_group, self.topk_group, self.scale = top_k, n_group, topk_group, scale
        self.weight = nn.Parameter(torch.randn(n_experts, hidden) * 0.02)
        # NOTE: non-zero (as in a trained model) so that selection differs from ranking the plain scores.
        self.register_buffer("e_score_correction_bias", torch.randn(n_experts) * 0.01)

    def forward(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(expert ids [T, k], weights [T, k], sigmoid scores of every expert [T, E])``."""
        scores = torch.sigmoid(F.linear(flat.float(), self.weight.float()))
        biased = scores.detach() + self.e_score_correction_bias
        t, e = biased.shape
        grouped = biased.view(t, self.n_group, e // self.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_score).scatter(1, group_score.topk(self.topk_group, dim=-1).indices, 1.0)
        allowed = kept.unsqueeze(-1).expand_as(grouped).reshape(t, e) > 0
        top_i = biased.masked_fill(~allowed, float("-inf")).topk(self.top_k, dim=-1).indices
        top_w = scores.gather(1, top_i)
        return top_i, self.scale * top_w / top_w.sum(dim=-1, keepdim=True), scores


def sequence_balance_loss(scores: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss on ``scores [B, T, E]``, ``top_i [B, T, k]``: the mean over
    sequences of ``sum_e f_e * P_e``, f_e = E/(k*T) * #tokens choosing e, P_e = mean normalized affinity."""
    _, t, e = scores.shape
    # NOTE: choices are counted with scatter (not bincount) so every shape stays static.
    chosen = torch.zeros_like(scores).scatter(2, top_i, 1.0)
    f = chosen.sum(dim=1) * (e / (top_i.size(-1) * t))
    p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)
    return (f * p).sum(dim=-1).mean()


class DeepseekMoe(nn.Module):
    """Shared experts on every token plus fine-grained group-limited routed experts.

    The routed experts are :class:`StackedExperts` (meshfold folds them into one op it can split by expert).
    """

    def __init__(self, hidden: int, inter: int, n_experts: int = 8, top_k: int = 3, n_shared: int = 2) -> None:
        super().__init__()
        self.gate = GroupLimitedRouter(hidden, n_experts, top_k, n_group=2, topk_group=1, scale=2.5)
        self.experts = StackedExperts(n_experts, hidden, inter)
        self.shared_experts = LlamaMLP(hidden, inter * n_shared)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        top_i, top_w, scores = self.gate(flat)
        out = self.experts(flat, top_i, top_w.to(x.dtype)) + self.shared_experts(flat)
        return out.reshape(b, t, h), sequence_balance_loss(scores.view(b, t, -1), top_i.view(b, t, -1))


class DeepseekLayer(nn.Module):
    """Pre-RMSNorm decoder layer: GQA attention, then a dense SwiGLU MLP or a :class:`DeepseekMoe`."""

    def __init__(self, hidden: int, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, n_heads=4, n_kv_heads=2, head_dim=hidden // 4)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.is_moe = moe
        self.mlp: nn.Module = DeepseekMoe(hidden, 32) if moe else LlamaMLP(hidden, 128)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        if not self.is_moe:
            return x + self.mlp(self.post_attention_layernorm(x))
        out, balance = self.mlp(self.post_attention_layernorm(x))
        aux.append(balance)
        return x + out


class DeepseekTiny(nn.Module):
    """DeepSeek-V3 style causal LM without MLA: layer 0 dense, later layers group-limited sigmoid MoE."""

    def __init__(self, vocab: int = 256, hidden: int = 64, n_layers: int = 3, aux_coef: float = 1e-3) -> None:
        super().__init__()
        self.aux_coef = aux_coef
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.rotary = Rotary(hidden // 4)
        self.layers = nn.ModuleList(DeepseekLayer(hidden, moe=i > 0) for i in range(n_layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.apply(_small_init)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(input_ids.size(1))
        x = self.embed_tokens(input_ids)
        balance: list[torch.Tensor] = []
        for layer in self.layers:
            x = layer(x, cos, sin, balance)
        return _shifted_ce(self.lm_head(self.norm(x)), labels) + self.aux_coef * torch.stack(balance).sum()


@register("deepseek-tiny")
def _deepseek_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """DeepSeek-V3 tiny (3 layers, 8 routed experts top-3 in 2 groups keep 1, 2x shared) on ``(input_ids, labels)``."""
    return _seeded(DeepseekTiny), _token_inputs(256)


class MarkedMoe(nn.Module):
    """An MoE language model whose experts code meshfold cannot recognize by itself (its own weight
    names, top-1 routing) but marks with ``meshfold.moe_experts``."""

    def __init__(self, vocab: int = 256, hidden: int = 64, inter: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.05)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, inter) * 0.05)
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from meshfold import moe_experts

        x = self.embed(input_ids)
        flat = x.reshape(-1, x.size(-1))
        probs = F.softmax(self.router(flat), dim=-1)
        top_w, top_i = torch.topk(probs, 1, dim=-1)
        y = moe_experts(flat, top_i, top_w, self.w_in, self.w_out, act="gelu")
        return _shifted_ce(self.head(self.norm(x + y.view_as(x))), labels)


@register("marked-moe-tiny")
def _marked_moe_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A top-1 MoE written against ``meshfold.moe_experts`` (weights ``w_in``/``w_out``)."""
    return _seeded(MarkedMoe), _token_inputs(256)
