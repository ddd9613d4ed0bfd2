"""Zoo entries built from transformers' config classes with random weights (the ``hf`` extra)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# NOTE: ``register`` adds an entry to the zoo's registry (``shared``); zoo/__init__ imports this module
from meshfold.tools.zoo.shared import _seeded, _token_inputs, register


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


@register("hf-mistral-window")
def _hf_mistral_window() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """transformers' MistralForCausalLM attending over a sliding window of 8 tokens (its mask hides
    every key further back), with random weights."""
    from transformers import MistralConfig, MistralForCausalLM

    return _hf_causal_lm(MistralConfig, MistralForCausalLM, intermediate_size=128, sliding_window=8)


@register("hf-llama-eager")
def _hf_llama_eager() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:func:`_hf_llama` with HF's "eager" attention: ``softmax(Q Kᵀ · scale + mask) V`` written out
    (grouped-query keys repeated first, an additive causal mask of the dtype's lowest value)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _hf_causal_lm(
        LlamaConfig, LlamaForCausalLM, _HF_COMMON | {"attn_implementation": "eager"}, intermediate_size=128
    )


@register("hf-llama-padded")
def _hf_llama_padded() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:func:`_hf_llama` where token id 0 is padding: the attention mask HF builds from it hides those
    keys (a padding mask beside the causal one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    padded = _padded_cls(_hf_loss_cls(LlamaForCausalLM))
    config = LlamaConfig(**_HF_COMMON, intermediate_size=128)
    ids, _ = _token_inputs(256)
    ids = ids.clamp(min=1)
    ids[0, :5] = 0  # NOTE: the first sequence padded on the left, the second on the right
    ids[1, -3:] = 0
    return _seeded(lambda: padded(config)), (ids, ids.clone())


@functools.cache
def _padded_cls(base: type[nn.Module]) -> type[nn.Module]:
    """``base`` (an ``_hf_loss_cls``) whose forward masks the keys at padding tokens (id 0)."""

    class Padded(base):  # type: ignore[misc, valid-type]
        """HF causal LM over ids where 0 is padding."""

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            mask = (input_ids != 0).long()
            out = super(base, self).forward(input_ids=input_ids, attention_mask=mask, labels=labels, use_cache=False)
            return out.loss

    Padded.__name__ = Padded.__qualname__ = f"{base.__name__}Padded"
    return Padded


@register("hf-llama-packed")
def _hf_llama_packed() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:func:`_hf_llama` over a packed row of variable-length sequences (``meshfold.packing``): its
    forward takes ``(input_ids, position_ids, doc_ids, labels)`` and each query sees the keys of its
    own sequence up to its position (``doc_mask``), whatever order the tokens are in. The example
    is nine sequences of 40 to 2 tokens in one row of 96, in order (one device's packing)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshfold.packing import pack_sequences

    packed = _packed_cls(LlamaForCausalLM)
    config = LlamaConfig(**_HF_COMMON, intermediate_size=128)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 256, (n,), generator=g) for n in PACKED_LENGTHS]
    return _seeded(lambda: packed(config)), pack_sequences(seqs, ranks=1, tokens=PACKED_TOKENS).inputs()


PACKED_LENGTHS = (40, 3, 9, 2, 12, 5, 7, 4, 6)
PACKED_TOKENS = 96
"""The lengths of ``hf-llama-packed``'s example sequences, one long and the rest short, and the
tokens of the row they are packed in."""


@functools.cache
def _packed_cls(base: type[nn.Module]) -> type[nn.Module]:
    """``base`` (an HF ``*ForCausalLM``) over a packed row: ``doc_mask`` as its attention mask, the
    given positions, and cross-entropy against labels already shifted within each sequence."""

    class Packed(base):  # type: ignore[misc, valid-type]
        """HF causal LM over packed variable-length sequences."""

        def forward(  # type: ignore[override]
            self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor, labels: torch.Tensor
        ) -> torch.Tensor:
            from meshfold.packing import IGNORE, doc_mask

            mask = doc_mask(doc_ids, position_ids)
            logits = (
                super()
                .forward(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
                .logits
            )
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)

    Packed.__name__ = Packed.__qualname__ = f"{base.__name__}Packed"
    return Packed


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


# NOTE: also the deepseek-v3 stacks of any depth the solve-scale tests build.
DEEPSEEK_V3_TINY: dict[str, Any] = {
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}


@register("hf-deepseek-v3")
def _hf_deepseek_v3() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """transformers' DeepseekV3ForCausalLM (MLA, group-limited sigmoid routing, a shared expert, dense
    first layer; 8 routed experts, top-2) with random weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return _hf_causal_lm(DeepseekV3Config, DeepseekV3ForCausalLM, _HF_COMMON | DEEPSEEK_V3_TINY)


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


@register("hf-qwen3-next")
def _hf_qwen3_next() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """transformers' Qwen3NextForCausalLM: a gated DeltaNet layer (a short causal convolution, then the
    gated delta rule run chunk by chunk over the sequence, its state carried from chunk to chunk), then
    a gated softmax-attention layer; dense MLPs; random weights. The example is one sequence of 128
    tokens: two of HF's 64-token chunks, so the loop over them is there to capture."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    model, _ = _hf_causal_lm(
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        head_dim=16,
        intermediate_size=128,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        mlp_only_layers=[0, 1],
    )
    ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone())


@register("hf-mamba")
def _hf_mamba() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """transformers' MambaForCausalLM (two layers; each a short causal convolution, then the selective
    state-space scan HF runs token by token without its kernels: every state entry decays by its own
    factor), with random weights."""
    return hf_mamba(32)


def hf_mamba(hidden: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:func:`_hf_mamba` ``hidden`` wide (intermediate ``2 * hidden``) on the zoo's token inputs."""
    from transformers import MambaConfig, MambaForCausalLM

    config = {"vocab_size": 256, "hidden_size": hidden, "state_size": 8, "num_hidden_layers": 2}
    return _hf_causal_lm(MambaConfig, MambaForCausalLM, config, intermediate_size=2 * hidden, use_mambapy=False)
