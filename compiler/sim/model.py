"""Decoder-only transformer descriptions: shapes, parameter counts and model FLOPs.

``ModelSpec`` is plain frozen data. Its matmuls are listed once per layer kind (``Matmul``: input
features, output features, and how tensor parallelism splits it), so the simulator and the FLOP
count read the same shapes. Model FLOPs follow Megatron-LM's MFU convention: forward matmuls plus
the attention score and value products, training = 3x forward, recomputation never counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# NOTE: split kinds. "col": output features sharded over the tensor-parallel group (input
# replicated); "row": input features sharded (output partial, reduced afterwards); "rep": the
# weight is replicated and every rank computes the whole product on its tokens.
SPLITS = ("col", "row", "rep")


@dataclass(frozen=True, slots=True)
class Matmul:
    """One weight matmul applied to every token: ``tokens x k @ k x n``, split by ``split``."""

    name: str
    k: int
    n: int
    split: str

    @property
    def params(self) -> int:
        """Weight elements (no bias)."""
        return self.k * self.n


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer. ``kv_heads=None`` means multi-head attention (= ``heads``);
    ``head_dim=None`` means ``hidden // heads``. MoE layers exist when ``num_experts > 0``: the
    first ``first_k_dense`` layers stay dense, the rest route each token to ``top_k`` of
    ``num_experts`` experts of width ``moe_ffn_hidden`` plus ``shared_experts`` always-on experts
    of the same width. ``routing_imbalance`` >= 1 is the busiest expert rank's load over the mean.
    ``kv_lora_rank > 0`` selects multi-head latent attention (DeepSeek-V2/V3)."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    vocab: int
    kv_heads: int | None = None
    head_dim: int | None = None
    gated_mlp: bool = True
    tied_embeddings: bool = False
    linear_bias: bool = False
    layernorm_bias: bool = False
    learned_positions: int = 0
    num_experts: int = 0
    top_k: int = 0
    moe_ffn_hidden: int = 0
    shared_experts: int = 0
    first_k_dense: int = 0
    routing_imbalance: float = 1.0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "ffn_hidden", "vocab"):
            if getattr(self, field) < 1:
                raise ValueError(f"model {self.name}: {field} must be >= 1, got {getattr(self, field)}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(
                f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"model {self.name}: hidden ({self.hidden}) % heads ({self.heads}) != 0; give head_dim")
        if self.num_experts:
            if not 1 <= self.top_k <= self.num_experts:
                raise ValueError(
                    f"model {self.name}: top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}"
                )
            if self.moe_ffn_hidden < 1:
                raise ValueError(f"model {self.name}: MoE needs moe_ffn_hidden >= 1")
            if not 0 <= self.first_k_dense <= self.layers:
                raise ValueError(f"model {self.name}: first_k_dense must be in 0..layers")
        if self.routing_imbalance < 1.0:
            raise ValueError(f"model {self.name}: routing_imbalance must be >= 1.0, got {self.routing_imbalance}")

    # --- shapes ----------------------------------------------------------------------------------
    @property
    def n_kv_heads(self) -> int:
        """Key/value heads (= heads for multi-head attention)."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys (incl. the rotary part under MLA)."""
        base = self.head_dim if self.head_dim is not None else self.hidden // self.heads
        return base + self.qk_rope_dim

    @property
    def v_dim(self) -> int:
        """Per-head width of values."""
        if self.v_head_dim:
            return self.v_head_dim
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention."""
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        """Layers with routed experts."""
        return self.layers - self.first_k_dense if self.num_experts else 0

    @property
    def dense_layers(self) -> int:
        """Layers with a dense MLP."""
        return self.layers - self.moe_layers

    def attention_matmuls(self) -> tuple[Matmul, ...]:
        """Projection matmuls of one attention block (queries, keys, values, output)."""
        h, a, qk, v = self.hidden, self.heads, self.qk_head_dim, self.v_dim
        if self.is_mla:
            mms: list[Matmul] = []
            if self.q_lora_rank:
                mms += [Matmul("q_down", h, self.q_lora_rank, "rep"), Matmul("q_up", self.q_lora_rank, a * qk, "col")]
            else:
                mms.append(Matmul("q_proj", h, a * qk, "col"))
            mms += [
                Matmul("kv_down", h, self.kv_lora_rank + self.qk_rope_dim, "rep"),
                Matmul("kv_up", self.kv_lora_rank, a * (qk - self.qk_rope_dim + v), "col"),
                Matmul("o_proj", a * v, h, "row"),
            ]
            return tuple(mms)
        kv = self.n_kv_heads * qk
        return (Matmul("qkv_proj", h, a * qk + 2 * kv, "col"), Matmul("o_proj", a * v, h, "row"))

    def mlp_matmuls(self, width: int | None = None) -> tuple[Matmul, ...]:
        """Matmuls of one (dense or single-expert) MLP of ``width`` (default ``ffn_hidden``)."""
        f = width if width is not None else self.ffn_hidden
        up = 2 * f if self.gated_mlp else f
        return (Matmul("fc1", self.hidden, up, "col"), Matmul("fc2", f, self.hidden, "row"))

    # --- parameters ------------------------------------------------------------------------------
    def attention_params(self) -> int:
        """Parameters of one attention block (projections and their biases)."""
        n = sum(m.params for m in self.attention_matmuls())
        if self.linear_bias:
            n += sum(m.n for m in self.attention_matmuls())
        return n

    def mlp_params(self, width: int | None = None) -> int:
        """Parameters of one MLP of ``width`` (default ``ffn_hidden``)."""
        n = sum(m.params for m in self.mlp_matmuls(width))
        if self.linear_bias:
            n += sum(m.n for m in self.mlp_matmuls(width))
        return n

    def norm_params(self) -> int:
        """Parameters of one normalisation (scale, plus shift for LayerNorm with bias)."""
        return self.hidden * (2 if self.layernorm_bias else 1)

    def expert_params(self) -> int:
        """Routed-expert parameters of one MoE layer (all experts)."""
        return self.num_experts * self.mlp_params(self.moe_ffn_hidden)

    def dense_layer_params(self) -> int:
        """Parameters of one dense layer (attention, MLP, two norms)."""
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def moe_layer_params(self) -> int:
        """Parameters of one MoE layer (attention, norms, router, shared and routed experts)."""
        shared = self.mlp_params(self.moe_ffn_hidden * self.shared_experts) if self.shared_experts else 0
        router = self.hidden * self.num_experts
        return self.attention_params() + 2 * self.norm_params() + router + shared + self.expert_params()

    def embedding_params(self) -> int:
        """Token (+ learned position) embedding, and the LM head when untied, plus the final norm."""
        n = self.vocab * self.hidden + self.learned_positions * self.hidden + self.norm_params()
        return n if self.tied_embeddings else n + self.vocab * self.hidden

    def param_count(self) -> int:
        """Total parameters (every expert counted)."""
        return (
            self.dense_layers * self.dense_layer_params()
            + self.moe_layers * self.moe_layer_params()
            + self.embedding_params()
        )

    def active_param_count(self) -> int:
        """Parameters one token touches (top_k routed experts + shared experts)."""
        inactive = (self.num_experts - self.top_k) * self.mlp_params(self.moe_ffn_hidden)
        return self.param_count() - self.moe_layers * inactive

    # --- FLOPs -----------------------------------------------------------------------------------
    def attention_score_flops(self, seq_len: int, causal: bool = False) -> float:
        """Forward FLOPs per token of one layer's score (Q K^T) and value (P V) products."""
        ctx = (seq_len + 1) / 2 if causal else float(seq_len)
        return 2.0 * ctx * self.heads * (self.qk_head_dim + self.v_dim)

    def flops_per_token(self, seq_len: int, *, causal: bool = False, training: bool = True) -> float:
        """Model FLOPs per token: 2 x every weight matmul a token passes through (attention
        projections, dense or top_k + shared expert MLPs, router, LM head) plus attention scores and
        values over ``seq_len`` keys (half of them on average when ``causal``); x3 for training."""
        attn = 2.0 * sum(m.params for m in self.attention_matmuls()) + self.attention_score_flops(seq_len, causal)
        dense = 2.0 * sum(m.params for m in self.mlp_matmuls())
        moe = 0.0
        if self.num_experts:
            active = self.top_k + self.shared_experts
            moe = 2.0 * (
                active * sum(m.params for m in self.mlp_matmuls(self.moe_ffn_hidden)) + self.hidden * self.num_experts
            )
        fwd = self.layers * attn + self.dense_layers * dense + self.moe_layers * moe + 2.0 * self.hidden * self.vocab
        return 3.0 * fwd if training else fwd


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


_NON_GATED = ("gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi")


def from_hf_config(cfg: Mapping[str, Any], name: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config dict (LlamaConfig-, MistralConfig-,
    MixtralConfig-, Qwen2/3(-MoE)-, GPT2Config- or DeepSeek-V3-style keys).

    GPT-2 style (``n_embd``/``n_layer``) means LayerNorm with bias, biased linears, GELU MLP of
    ``n_inner`` (default 4h), learned positions and tied embeddings; everything else defaults to
    RMSNorm, SwiGLU and untied embeddings unless the config says otherwise. Raises ValueError
    naming the missing key."""
    model_type = str(_get(cfg, "model_type", default=""))
    gpt2_like = "n_embd" in cfg or model_type in _NON_GATED
    hidden = _get(cfg, "hidden_size", "n_embd", "d_model")
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    vocab = _get(cfg, "vocab_size")
    for key, value in (
        ("hidden_size", hidden),
        ("num_hidden_layers", layers),
        ("num_attention_heads", heads),
        ("vocab_size", vocab),
    ):
        if value is None:
            raise ValueError(f"HF config has no {key!r} (or its GPT-2 spelling); keys present: {sorted(cfg)}")
    ffn = _get(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * int(hidden))
    experts = int(_get(cfg, "num_local_experts", "n_routed_experts", "num_experts", default=0))
    moe_ffn = int(_get(cfg, "moe_intermediate_size", default=ffn if experts else 0))
    shared = int(_get(cfg, "n_shared_experts", default=0))
    if not shared and _get(cfg, "shared_expert_intermediate_size") and moe_ffn:
        shared = max(1, int(cfg["shared_expert_intermediate_size"]) // moe_ffn)
    kv_lora = int(_get(cfg, "kv_lora_rank", default=0))
    head_dim = _get(cfg, "qk_nope_head_dim") if kv_lora else _get(cfg, "head_dim")
    return ModelSpec(
        name=name or str(_get(cfg, "_name_or_path", "model_type", default="hf-model")),
        layers=int(layers),
        hidden=int(hidden),
        heads=int(heads),
        ffn_hidden=int(ffn),
        vocab=int(vocab),
        kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(head_dim) if head_dim is not None else None,
        gated_mlp=not gpt2_like,
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", default=gpt2_like)),
        linear_bias=gpt2_like or bool(_get(cfg, "attention_bias", "mlp_bias", default=False)),
        layernorm_bias=gpt2_like,
        learned_positions=int(_get(cfg, "n_positions", default=0)) if gpt2_like else 0,
        num_experts=experts,
        top_k=int(_get(cfg, "num_experts_per_tok", "moe_topk", default=2 if experts else 0)) if experts else 0,
        moe_ffn_hidden=moe_ffn if experts else 0,
        shared_experts=shared if experts else 0,
        first_k_dense=int(_get(cfg, "first_k_dense_replace", default=0)) if experts else 0,
        q_lora_rank=int(_get(cfg, "q_lora_rank", default=0)) if kv_lora else 0,
        kv_lora_rank=kv_lora,
        qk_rope_dim=int(_get(cfg, "qk_rope_head_dim", default=0)) if kv_lora else 0,
        v_head_dim=int(_get(cfg, "v_head_dim", default=0)) if kv_lora else 0,
    )


def gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 131072) -> ModelSpec:
    """A Megatron-style GPT: MHA, 4h GELU MLP with biases, LayerNorm, untied embeddings."""
    return ModelSpec(
        name, layers, hidden, heads, 4 * hidden, vocab, gated_mlp=False, linear_bias=True, layernorm_bias=True
    )


# Published architectures (Meta Llama 3 model card / config.json; Mistral AI Mixtral-8x7B and
# Mixtral-8x22B-v0.1 config.json; DeepSeek-V3 config.json).
PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 14336, 128256, kv_heads=8),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 28672, 128256, kv_heads=8),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 53248, 128256, kv_heads=8),
    "mixtral-8x7b": ModelSpec(
        "mixtral-8x7b", 32, 4096, 32, 14336, 32000, kv_heads=8, num_experts=8, top_k=2, moe_ffn_hidden=14336
    ),
    "mixtral-8x22b": ModelSpec(
        "mixtral-8x22b", 56, 6144, 48, 16384, 32000, kv_heads=8, num_experts=8, top_k=2, moe_ffn_hidden=16384
    ),
    "deepseek-v3": ModelSpec(
        "deepseek-v3",
        61,
        7168,
        128,
        18432,
        129280,
        kv_heads=128,
        head_dim=128,
        num_experts=256,
        top_k=8,
        moe_ffn_hidden=2048,
        shared_experts=1,
        first_k_dense=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_dim=64,
        v_head_dim=128,
    ),
}


def preset(name: str) -> ModelSpec:
    """A published architecture by name; ValueError lists the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
