"""The hand-written zoo entries: an MLP, GPT-2, Llama and Mixtral, tiny."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

# NOTE: ``register`` adds an entry to the zoo's registry (``shared``); zoo/__init__ imports this module
from meshfold.tools.zoo.shared import SEQ, _seeded, _shifted_ce, _small_init, _token_inputs, register


class MLP(nn.Module):
    """Three-layer GELU MLP trained with MSE against a target."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x))))), target)


@register("mlp")
def _mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny MLP with inputs ``(x: f32[8,32], target: f32[8,16])``."""
    g = torch.Generator().manual_seed(0)
    return _seeded(MLP), (torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g))


class GPT2Attention(nn.Module):
    """Causal multi-head self-attention with a fused qkv projection."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class GPT2MLP(nn.Module):
    """GPT-2 feed-forward: 4x expansion with tanh-approximate GELU."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = GPT2Attention(d_model, n_heads)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = GPT2MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Tiny(nn.Module):
    """GPT-2 style causal LM with an LM head tied to the token embedding."""

    def __init__(self, vocab: int = 128, d_model: int = 64, n_heads: int = 4, max_seq: int = SEQ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(max_seq, d_model)
        self.h = nn.ModuleList(GPT2Block(d_model, n_heads) for _ in range(2))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.apply(_small_init)
        # NOTE: tie after init so lm_head and wte share one Parameter object.
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return _shifted_ce(self.lm_head(self.ln_f(x)), labels)


@register("gpt2-tiny")
def _gpt2_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """GPT-2 tiny (vocab 128, d 64, 4 heads, 2 blocks) on ``(input_ids, labels)``."""
    return _seeded(GPT2Tiny), _token_inputs(128)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32: x * rsqrt(mean(x^2) + eps) * weight."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Rotary(nn.Module):
    """Precomputed rotary cos/sin tables (non-persistent buffers)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_seq: int = 64, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embeddings to x [b, heads, t, head_dim] via rotate_half: (x1, x2) -> (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)  # NOTE: fp32 tables, x bf16 maybe


class LlamaAttention(nn.Module):
    """Grouped-query causal attention with rotary embeddings and no biases."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Expand [b, kv, t, d] to [b, heads, t, d]; each kv head serves consecutive q heads."""
        b, kv, t, d = x.shape
        rep = self.n_heads // self.n_kv_heads
        return x[:, :, None].expand(b, kv, rep, t, d).reshape(b, kv * rep, t, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoeExpert(nn.Module):
    """One SwiGLU expert: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoeBlock(nn.Module):
    """Top-k routed MoE over an ``nn.ModuleList`` of experts, dense dispatch (every expert sees every token)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(MoeExpert(hidden, intermediate) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        router_logits = self.gate(flat)
        probs = F.softmax(router_logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        # NOTE: dense dispatch keeps all shapes static; unselected experts get weight 0.
        dense_w = torch.zeros_like(probs).scatter(1, top_i, top_w).to(x.dtype)
        expert_out = torch.stack([expert(flat) for expert in self.experts], dim=1)
        out = (dense_w.unsqueeze(-1) * expert_out).sum(dim=1)
        return out.reshape(b, t, h), router_logits


class StackedExperts(nn.Module):
    """``num_experts`` SwiGLU experts with stacked weights, in the layout meshfold folds into one op.

    ``gate_up_proj [E, 2I, H]`` stacks each expert's gate rows over its up rows, ``down_proj [E, H, I]``.
    ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``: token ``t`` gets
    ``sum_j w[t, j] * down_e @ (silu(gate_e @ x_t) * (up_e @ x_t))`` with ``e = top_k_index[t, j]``,
    which is ``ir.dialects.moe.experts``. Eagerly every expert runs on every token and the k chosen are
    gathered, so all shapes are static and the module also captures as it is.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * intermediate, hidden) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, intermediate) * 0.02)
        # NOTE: read by meshfold.tracing.moe_layers's detection, as it reads a transformers experts module's config.
        self.config = types.SimpleNamespace(hidden_act="silu")

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("th,egh->teg", hidden, self.gate_up_proj).chunk(2, dim=-1)
        every = torch.einsum("tei,ehi->teh", F.silu(gate) * up, self.down_proj)
        index = top_k_index.unsqueeze(-1).expand(-1, -1, hidden.size(-1))
        chosen = every.gather(1, index)
        return (chosen * top_k_weights.unsqueeze(-1).to(chosen.dtype)).sum(dim=1)


def route_top_k(gate: nn.Linear, flat: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixtral routing of ``flat [T, H]``: ``(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])``,
    the weights a softmax (fp32) over all experts, kept top-k and renormalized to sum 1."""
    router_logits = gate(flat)
    probs = F.softmax(router_logits.float(), dim=-1)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    return router_logits, top_w / top_w.sum(dim=-1, keepdim=True), top_i


class StackedMoeBlock(nn.Module):
    """Mixtral's top-k routed MoE (softmax router, top-k renormalized) over :class:`StackedExperts`."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        router_logits, top_w, top_i = route_top_k(self.gate, flat, self.top_k)
        return self.experts(flat, top_i, top_w.to(x.dtype)).reshape(b, t, h), router_logits


def load_balancing_loss(router_logits: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch/Mixtral aux loss: num_experts * sum_e(token_fraction_e * mean_router_prob_e)."""
    probs = F.softmax(router_logits.float(), dim=-1)
    _, top_i = torch.topk(probs, top_k, dim=-1)
    # NOTE: assignments counted via scatter (not bincount) to stay free of data-dependent shapes.
    assigned = torch.zeros_like(probs).scatter(1, top_i, 1.0)
    tokens_per_expert = assigned.mean(dim=0)
    prob_per_expert = probs.mean(dim=0)
    return num_experts * torch.sum(tokens_per_expert * prob_per_expert)


class DecoderLayer(nn.Module):
    """Pre-RMSNorm decoder layer: GQA attention, then SwiGLU MLP or (num_experts > 0) a sparse MoE whose
    experts are stacked (:class:`StackedMoeBlock`) or, with ``stacked=False``, an ``nn.ModuleList``."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int = 0, stacked: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, n_heads=4, n_kv_heads=2, head_dim=hidden // 4)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.is_moe = num_experts > 0
        if self.is_moe:
            block = StackedMoeBlock if stacked else SparseMoeBlock
            self.block_sparse_moe: nn.Module = block(hidden, intermediate, num_experts)
        else:
            self.mlp = LlamaMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + self.mlp(h)
        moe_out, router_logits = self.block_sparse_moe(h)
        aux.append(router_logits)
        return x + moe_out


class LlamaTiny(nn.Module):
    """Llama style causal LM with GQA, RoPE, SwiGLU and an untied LM head."""

    def __init__(
        self, vocab: int = 256, hidden: int = 64, intermediate: int = 128, num_experts: int = 0, stacked: bool = True
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.aux_coef = num_experts, 2, 0.01
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.rotary = Rotary(hidden // 4)
        self.layers = nn.ModuleList(DecoderLayer(hidden, intermediate, num_experts, stacked) for _ in range(2))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.apply(_small_init)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(input_ids.size(1))
        x = self.embed_tokens(input_ids)
        router_logits: list[torch.Tensor] = []
        for layer in self.layers:
            x = layer(x, cos, sin, router_logits)
        loss = _shifted_ce(self.lm_head(self.norm(x)), labels)
        # NOTE: `router_logits` is a Python list whose length is fixed by the architecture, not by data.
        if router_logits:
            # NOTE: like HF Mixtral, the aux loss pools router logits of all layers before averaging.
            aux = load_balancing_loss(torch.cat(router_logits, dim=0), self.num_experts, self.top_k)
            loss = loss + self.aux_coef * aux
        return loss


class MixtralTiny(LlamaTiny):
    """Mixtral style causal LM: llama-tiny attention plus top-2-of-4 MoE (stacked experts) and 0.01 aux loss."""

    def __init__(self) -> None:
        super().__init__(intermediate=96, num_experts=4)


class MixtralListTiny(LlamaTiny):
    """:class:`MixtralTiny` with each layer's experts an ``nn.ModuleList`` run densely (meshfold leaves
    those replicated, with a warning)."""

    def __init__(self) -> None:
        super().__init__(intermediate=96, num_experts=4, stacked=False)


@register("llama-tiny")
def _llama_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Llama tiny (vocab 256, hidden 64, 4q/2kv heads, 2 layers) on ``(input_ids, labels)``."""
    return _seeded(LlamaTiny), _token_inputs(256)


@register("mixtral-tiny")
def _mixtral_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Mixtral tiny (4 stacked experts, top-2) on ``(input_ids, labels)``."""
    return _seeded(MixtralTiny), _token_inputs(256)


@register("mixtral-list-tiny")
def _mixtral_list_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Mixtral tiny with ``nn.ModuleList`` experts (4, top-2, dense dispatch) on ``(input_ids, labels)``."""
    return _seeded(MixtralListTiny), _token_inputs(256)
