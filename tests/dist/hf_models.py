"""Small HF causal LMs beyond Llama/Mixtral, built from their config classes with random weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshfold.tools.zoo.hf_zoo import _hf_loss_cls

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def build_hf(
    arch: str, layers: int = 2, batch: int = 4, seq: int = 16
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """``(model, (ids, labels))`` for one of ``gpt2``, ``qwen2``, ``mistral``, ``phi3``, ``gemma``, with
    ``layers`` decoder layers, on ``batch`` sequences of ``seq`` tokens."""
    small = SMALL | {"num_hidden_layers": layers}
    import transformers as tf

    configs: dict[str, tuple[Any, Any]] = {
        "gpt2": (
            tf.GPT2Config(
                vocab_size=256,
                n_embd=64,
                n_layer=layers,
                n_head=4,
                n_positions=64,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            ),
            tf.GPT2LMHeadModel,
        ),
        "qwen2": (tf.Qwen2Config(**small), tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig(**small), tf.MistralForCausalLM),
        "phi3": (tf.Phi3Config(**small, pad_token_id=0), tf.Phi3ForCausalLM),
        "gemma": (tf.GemmaConfig(**small, head_dim=16), tf.GemmaForCausalLM),
    }
    config, cls = configs[arch]
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = _hf_loss_cls(cls)(config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch, seq), generator=gen)
    return model, (ids, ids.clone())
