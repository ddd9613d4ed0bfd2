"""Built-in zoo of small models used by tests, the CLI and demos.

Every entry is a factory returning ``(model, example_inputs)`` where
``model(*example_inputs)`` is a scalar fp32 loss. Factories are deterministic
(weights under ``torch.manual_seed(0)``, inputs from a generator seeded with 0)
and construct nothing data-dependent, so they also run under ``FakeTensorMode``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ZooFactory = Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]

_REGISTRY: dict[str, ZooFactory] = {}

BATCH = 2
SEQ = 16


def register(name: str) -> Callable[[ZooFactory], ZooFactory]:
    """Register a zoo factory under ``name`` (import time only)."""

    def deco(fn: ZooFactory) -> ZooFactory:
        if name in _REGISTRY:
            raise ValueError(f"zoo model {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def zoo_names() -> list[str]:
    """Return the sorted names of all zoo models."""
    return sorted(_REGISTRY)


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build zoo model ``name`` and its example inputs."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(zoo_names())}") from None
    return factory()


def _seeded(ctor: Callable[[], nn.Module]) -> nn.Module:
    """Construct a module under ``torch.manual_seed(0)`` without leaking RNG state."""
    # NOTE: fork_rng restores the caller's global RNG, so building is side-effect free.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ctor()


def _token_inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(input_ids, labels)`` of shape [BATCH, SEQ]; labels equal the ids."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g, dtype=torch.long)
    return input_ids, input_ids.clone()


def _small_init(module: nn.Module) -> None:
    """GPT-style init: N(0, 0.02) for Linear/Embedding weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM cross-entropy: position t predicts label t+1, computed in fp32."""
    vocab = logits.size(-1)
    shift_logits = logits[:, :-1, :].reshape(-1, vocab).float()
    shift_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits, shift_labels)


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
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


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
    which is ``ir.moe.experts``. Eagerly every expert runs on every token and the k chosen are
    gathered, so all shapes are static and the module also captures as it is.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * intermediate, hidden) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, intermediate) * 0.02)
        # NOTE: read by compiler.moe's detection, as it reads a transformers experts module's config.
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


@functools.cache
def _hf_loss_cls(base: type[nn.Module]) -> type[nn.Module]:
    """Subclass an HF ``*ForCausalLM`` so forward(input_ids, labels) returns the loss, keeping HF FQNs."""

    class HFLoss(base):  # type: ignore[misc, valid-type]
        """HF causal LM returning only its (aux-inclusive) training loss."""

        def __init__(self, config: object) -> None:
            super().__init__(config)
            if getattr(config, "output_router_logits", False):
                from transformers.utils.output_capturing import maybe_install_capturing_hooks

                # NOTE: HF installs router-logit capture hooks lazily under a threading.Lock, which dynamo
                # cannot trace; installing them eagerly here keeps the forward capturable.
                maybe_install_capturing_hooks(self.model)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids=input_ids, labels=labels, use_cache=False).loss

    HFLoss.__name__ = HFLoss.__qualname__ = f"{base.__name__}Loss"
    return HFLoss


# NOTE: sizes mirror llama-tiny / mixtral-tiny so HF and hand-written entries are directly comparable.
_HF_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "attn_implementation": "sdpa",
    "loss_type": "ForCausalLM",
}


def _hf_causal_lm(
    config_cls: Any, lm_cls: type[nn.Module], common: dict[str, Any] = _HF_COMMON, **fields: Any
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``lm_cls`` (an HF ``*ForCausalLM``) on ``config_cls(**common, **fields)`` with seeded random
    weights, returning its loss on ``(input_ids, labels)``."""
    config = config_cls(**common, **fields)
    cls = _hf_loss_cls(lm_cls)
    return _seeded(lambda: cls(config)), _token_inputs(256)


@register("hf-llama")
def _hf_llama() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build transformers' LlamaForCausalLM with random weights (needs the transformers extra)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _hf_causal_lm(LlamaConfig, LlamaForCausalLM, intermediate_size=128)


@register("hf-mixtral")
def _hf_mixtral() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build transformers' MixtralForCausalLM with random weights (needs the transformers extra)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    # NOTE: HF's default "eager" experts loop over `nonzero()` hits; batched_mm is static-shape. It is passed
    # through **kwargs because MixtralConfig's typed signature does not list it.
    static_experts: dict[str, Any] = {"experts_implementation": "batched_mm"}
    return _hf_causal_lm(
        MixtralConfig,
        MixtralForCausalLM,
        **static_experts,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )


@register("hf-qwen3-moe")
def _hf_qwen3_moe() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """transformers' Qwen3MoeForCausalLM (8 experts, top-2, QK-norm attention) with random weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _hf_causal_lm(
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )


@register("hf-deepseek-v3")
def _hf_deepseek_v3() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """transformers' DeepseekV3ForCausalLM (MLA, group-limited sigmoid routing, a shared expert, dense
    first layer; 8 routed experts, top-2) with random weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return _hf_causal_lm(
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        _HF_COMMON | {"num_key_value_heads": 4},
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )


@register("hf-lfm2-moe")
def _hf_lfm2_moe() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """transformers' Lfm2MoeForCausalLM (a short-convolution layer with a dense MLP, then attention with
    8 experts top-2, sigmoid routing with a bias) with random weights. Its experts name no activation
    in their config (they call ``F.silu``): meshfold reads it off the module."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    return _hf_causal_lm(
        Lfm2MoeConfig,
        Lfm2MoeForCausalLM,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_dense_layers=1,
        num_experts=8,
        num_experts_per_tok=2,
        layer_types=["conv", "full_attention"],
    )


# NOTE: imported last: the MoE entries build on the classes above and register themselves.
from compiler import zoo_moe  # noqa: E402, F401
