"""transformers' decoder-only families in the corpus (``hf.decoder``): each entry names its config
and model classes and the fields that select the family's variant."""

from __future__ import annotations

from meshfold.tools.corpus.entries.hf_families import decoder

decoder("hf-llama", "LlamaConfig", "LlamaForCausalLM", "RMSNorm, rotary, grouped-query attention, SwiGLU")
decoder(
    "hf-gpt-neox",
    "GPTNeoXConfig",
    "GPTNeoXForCausalLM",
    "parallel residual x + attn(ln1(x)) + mlp(ln2(x)), biases on every projection, partial rotary",
    use_parallel_residual=True,
    rotary_pct=0.25,
)
decoder(
    "hf-phi",
    "PhiConfig",
    "PhiForCausalLM",
    "one shared LayerNorm feeding attention and MLP in parallel, biases, partial rotary",
    partial_rotary_factor=0.5,
)
decoder(
    "hf-stablelm",
    "StableLmConfig",
    "StableLmForCausalLM",
    "partial rotary, qk LayerNorm per head, qkv bias",
    # NOTE: more heads than layers, as the real model has (32 and 24): its per-head qk norms are a
    # ModuleList longer than the layer stack
    num_attention_heads=8,
    num_key_value_heads=4,
    partial_rotary_factor=0.5,
    qk_layernorm=True,
    use_qkv_bias=True,
)
decoder(
    "hf-mistral",
    "MistralConfig",
    "MistralForCausalLM",
    "sliding-window attention: each query sees the last 8 of 16 keys",
    sliding_window=8,
)
decoder("hf-qwen2", "Qwen2Config", "Qwen2ForCausalLM", "biases on q, k and v but not the output projection")
decoder("hf-qwen3", "Qwen3Config", "Qwen3ForCausalLM", "RMSNorm on each head's queries and keys (qk-norm)", head_dim=16)
decoder(
    "hf-gemma2",
    "Gemma2Config",
    "Gemma2ForCausalLM",
    "tanh soft-capped attention scores and logits, sliding and global layers alternating, sandwich norms",
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=8,
)
decoder("hf-phi3", "Phi3Config", "Phi3ForCausalLM", "fused qkv and gate-up projections, split in the forward")
decoder(
    "hf-gpt2",
    "GPT2Config",
    "GPT2LMHeadModel",
    "Conv1D (transposed-weight) projections, fused qkv, learned positions, tied head",
    n_inner=128,
)
decoder(
    "hf-gptj",
    "GPTJConfig",
    "GPTJForCausalLM",
    "parallel attention and MLP on one LayerNorm, interleaved partial rotary",
    rotary_dim=8,
    n_inner=128,
)
decoder(
    "hf-falcon",
    "FalconConfig",
    "FalconForCausalLM",
    "multi-query attention (one shared key/value head) in a fused projection, parallel attention and MLP",
    ffn_hidden_size=128,
)
decoder(
    "hf-olmo2",
    "Olmo2Config",
    "Olmo2ForCausalLM",
    "RMSNorm over the whole q and k projections, norms after attention and MLP rather than before",
)
decoder(
    "hf-cohere",
    "CohereConfig",
    "CohereForCausalLM",
    "parallel residual on one bias-free LayerNorm, interleaved rotary, logits scaled",
)
decoder(
    "hf-bloom",
    "BloomConfig",
    "BloomForCausalLM",
    "ALiBi: a per-head linear distance bias instead of positions, LayerNorm on the embeddings",
)
decoder(
    "hf-opt",
    "OPTConfig",
    "OPTForCausalLM",
    "learned positions offset by 2, ReLU MLP, biases everywhere",
    ffn_dim=128,
    word_embed_proj_dim=64,
)
decoder(
    "hf-gpt-bigcode",
    "GPTBigCodeConfig",
    "GPTBigCodeForCausalLM",
    "multi-query attention: one fused projection gives 4 query heads and one key/value head",
    n_inner=128,
)
