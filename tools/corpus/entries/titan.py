"""Corpus entries from torchtitan's own model definitions (Llama3, Qwen3, DeepSeek-V3), built small
(64 wide, 4 layers, a vocabulary of 256) from torchtitan 0.3.0's config classes and its own per-flavor
layer builders, initialised by the model's ``init_weights`` (its ``param_init`` tables) under a fixed
seed, and trained on 8 sequences of 16 tokens.

The model code is torchtitan's; ours are only the sizes, the attention backend and the loss:

* attention runs through torchtitan's ``ScaledDotProductAttention`` (causal SDPA, no mask): 0.3.0's
  language-model builders accept only ``flex``/``flex_flash``/``varlen``, so the layers are built with
  ``flex`` and their ``inner_attention`` config swapped before the model is built;
* the decoders return logits; ``TitanLM`` turns them into the mean cross-entropy over every label,
  unshifted as in torchtitan's trainer (whose dataloader shifts: ``input = seq[:-1]``, ``labels =
  seq[1:]``; so do ours).

What the entries keep of torchtitan: layers in an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ...; a RoPE
table per attention layer (``attention.rope.cache``, a non-persistent buffer): complex64 for Llama3 and
DeepSeek-V3 (``ComplexRoPE``, the variant 0.3.0 uses for both; the old name was ``freqs_cis``),
cos/sin float32 for Qwen3 (``CosSinRoPE``, the only one its builders use); Llama3's and Qwen3's fused
``wqkv`` laid out ``(n_kv_heads, heads_per_kv + 2, head_dim)`` (torchtitan's default ``fuse_qkv=True``);
Qwen3's per-head q/k RMSNorm and tied embedding (as in its small flavors); DeepSeek-V3's multi-head
latent attention (``q_lora_rank=0``, a 32-wide kv latent), one dense layer then three MoE layers (8
routed experts, top-2 softmax routing, one shared expert) whose experts run ``torch._grouped_mm`` in
bfloat16 and whose forward adds to the ``tokens_per_expert_E`` buffer in training mode.

Dependencies. Importing these model modules on CPU needs, beyond torch: ``torchtitan``, ``spmd_types``
(==0.2.3, imported throughout torchtitan.models and torchtitan.distributed), ``tyro`` (imported by
``torchtitan.config``, which the model configs' base class comes from) with its own requirements
(``docstring_parser``, ``typing_extensions``), and ``triton``: ``models.common.moe`` imports the token
dispatchers, which import ``torchtitan.distributed.minimal_async_ep``, whose kernels import triton
unconditionally, and every model package imports ``models.common``. ``einops``, ``datasets``,
``torchdata``, ``tokenizers``, ``safetensors``, ``tensorboard``, ``wandb``, ``pillow`` and
``torch_checkpointing`` (the rest of torchtitan's requirements) are not imported. torchtitan does
not list triton, and the CPU torch wheel does not bring it, so a plain ``pip install torchtitan`` on
a CPU machine leaves these imports failing until ``pip install triton``. ``REQUIRES`` names all four,
so an entry is skipped, not failed, where any is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.tools.corpus.catalog import Built, Entry, register, seeded, tokens

VOCAB = 256
DIM = 64
LAYERS = 4
HEADS = 4
KV_HEADS = 2
FFN = 128
MAX_SEQ = 64
"""Rows of each RoPE table (the inputs are 16 tokens long)."""
REQUIRES = ("torchtitan", "spmd_types", "tyro", "triton")
"""What importing torchtitan's model modules needs on CPU (the module docstring says why)."""
LM = frozenset({"attention", "stack", "deep", "tokens"})


class TitanLM(nn.Module):
    """A torchtitan decoder (it returns logits) with its training loss: ``forward(ids, labels)`` is the
    mean cross-entropy of the logits at every position against ``labels`` (already shifted)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _next_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 16 input tokens and their 16 next tokens (one draw of 17, split as torchtitan's
    dataloader splits it)."""
    seq = tokens(VOCAB, seq=17)
    return seq[:, :-1].clone(), seq[:, 1:].clone()


def _sdpa(layers: list[Any]) -> list[Any]:
    """``layers`` (torchtitan block configs) with every attention's inner attention set to SDPA."""
    from torchtitan.models.common import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def titan_lm(config: Callable[[], Any]) -> Callable[[], Built]:
    """A builder of the torchtitan model ``config()`` describes, initialised by its ``init_weights``
    under the corpus's seed, wrapped in ``TitanLM``, with next-token inputs."""

    def build() -> Built:
        def make() -> nn.Module:
            model = config().build()
            model.init_weights()
            return TitanLM(model)

        return seeded(make), _next_tokens()

    return build


def _decoder_parts(embedding_init: Any, norm: Any, head_init: Any) -> dict[str, Any]:
    """A decoder config's sizes, embedding, final norm and output head, with the flavor's initialisers."""
    from torchtitan.models.common import Embedding, Linear

    return {
        "dim": DIM,
        "vocab_size": VOCAB,
        "tok_embeddings": Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=embedding_init),
        "norm": norm,
        "lm_head": Linear.Config(in_features=DIM, out_features=VOCAB, param_init=head_init),
    }


def llama3() -> Any:
    """Llama3 as its flavors are built (``_build_llama3_layers``: RMSNorm, fused-qkv grouped-query
    attention, complex RoPE with llama scaling, SwiGLU, depth-scaled inits), small."""
    import torchtitan.models.llama3 as titan
    from torchtitan.models.common import ComplexRoPE, RMSNorm
    from torchtitan.models.llama3.model import Llama3Model

    layers = titan._build_llama3_layers(
        n_layers=LAYERS,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        hidden_dim=FFN,
        fuse_qkv=True,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=MAX_SEQ, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    parts = _decoder_parts(
        titan._EMBEDDING_INIT,
        RMSNorm.Config(normalized_shape=DIM, param_init=titan._NORM_INIT),
        titan._output_linear_init(DIM),
    )
    return Llama3Model.Config(layers=_sdpa(layers), **parts)


def qwen3() -> Any:
    """Qwen3 as its small flavors are built (``_build_qwen3_layers``: q/k RMSNorm per head, fused qkv,
    cos/sin RoPE, SwiGLU; the embedding tied to the output head), small."""
    import torchtitan.models.qwen3 as titan
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.qwen3.model import Qwen3Model

    head_dim = DIM // HEADS
    layers = titan._build_qwen3_layers(
        n_layers=LAYERS,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        head_dim=head_dim,
        hidden_dim=FFN,
        fuse_qkv=True,
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=MAX_SEQ, theta=1000000.0),
        attn_backend="flex",
    )
    # NOTE: the tied flavors skip the embedding's init (the output head's init covers the shared weight)
    parts = _decoder_parts(titan._EMBEDDING_SKIP_INIT, titan._qwen3_norm(DIM), titan._LINEAR_INIT)
    return Qwen3Model.Config(layers=_sdpa(layers), enable_weight_tying=True, **parts)


def deepseek_v3() -> Any:
    """DeepSeek-V3 as its flavors are built (``_build_dsv3_layers``: multi-head latent attention with
    complex YaRN RoPE, the first layer dense, the rest MoE with auxiliary-loss-free load balancing and
    a shared expert), small, without multi-token-prediction layers."""
    import torchtitan.models.deepseek_v3 as titan
    from torchtitan.models.common import ComplexRoPE, RMSNorm
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    rope_dim = 8
    layers = titan._build_dsv3_layers(
        n_layers=LAYERS,
        n_dense_layers=1,
        dim=DIM,
        n_heads=HEADS,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope_dim,
        v_head_dim=16,
        mscale=0.70,
        dense_hidden_dim=FFN,
        moe_hidden_dim=FFN // 2,
        num_experts=8,
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=rope_dim,
            max_seq_len=MAX_SEQ,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=4096,
        ),
    )
    parts = _decoder_parts(
        titan._EMBEDDING_INIT,
        RMSNorm.Config(normalized_shape=DIM, param_init=titan._NORM_INIT),
        titan._output_linear_init(DIM),
    )
    return DeepSeekV3Model.Config(layers=_sdpa(layers), **parts)


register(
    Entry(
        "titan-llama3",
        "decoder",
        "torchtitan.models.llama3.model.Llama3Model",
        titan_lm(llama3),
        LM,
        REQUIRES,
        note="fused wqkv grouped-query attention, complex64 RoPE table per layer, SwiGLU, layers in a ModuleDict",
    )
)
register(
    Entry(
        "titan-qwen3",
        "decoder",
        "torchtitan.models.qwen3.model.Qwen3Model",
        titan_lm(qwen3),
        LM,
        REQUIRES,
        note="q/k RMSNorm per head, fused wqkv, cos/sin RoPE, tied embedding, layers in a ModuleDict",
    )
)
register(
    Entry(
        "titan-deepseek-v3",
        "moe",
        "torchtitan.models.deepseek_v3.model.DeepSeekV3Model",
        titan_lm(deepseek_v3),
        LM | {"moe", "running-stats"},
        REQUIRES,
        note="multi-head latent attention, complex64 YaRN RoPE, 1 dense + 3 MoE layers (8 experts, "
        "top-2, a shared expert, bf16 grouped_mm); MoE counts tokens per expert in a buffer",
        precision="bf16",
    )
)
