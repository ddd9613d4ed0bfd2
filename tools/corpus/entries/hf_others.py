"""transformers' encoders, encoder-decoders, CNNs, mixtures of experts and hybrids in the corpus (one
``hf`` task each)."""

from __future__ import annotations

from meshfold.tools.corpus.entries.hf_families import SCAN, cnn, decoder, encoder, moe, seq2seq
from meshfold.tools.zoo.hf_zoo import DEEPSEEK_V3_TINY

# encoders (masked LM heads, labels = the inputs)
encoder(
    "hf-bert",
    "BertConfig",
    "BertForMaskedLM",
    "post-LayerNorm, learned positions and token types, MLM head with a transform and tied decoder",
)
encoder(
    "hf-roberta",
    "RobertaConfig",
    "RobertaForMaskedLM",
    "position ids counted from the padding id over the non-padding tokens (data-dependent)",
)
encoder(
    "hf-distilbert",
    "DistilBertConfig",
    "DistilBertForMaskedLM",
    "fixed sinusoidal position table (a frozen parameter), no token types",
    hidden_dim=128,
    sinusoidal_pos_embds=True,
)
encoder(
    "hf-albert",
    "AlbertConfig",
    "AlbertForMaskedLM",
    "one layer's weights applied four times (no stack), factorized 32-wide embeddings",
    traits=frozenset({"attention", "tokens"}),
    embedding_size=32,
)
encoder(
    "hf-modernbert",
    "ModernBertConfig",
    "ModernBertForMaskedLM",
    "global and 8-token local attention layers, rotary, GeGLU, no biases",
    local_attention=8,
    global_attn_every_n_layers=2,
)

# encoder-decoders (translation: labels shifted right are the decoder's inputs)
seq2seq(
    "hf-t5",
    "T5Config",
    "T5ForConditionalGeneration",
    "bucketed relative position bias computed once per stack, RMSNorm without mean, no biases",
    decoder_start_token_id=0,
)
seq2seq(
    "hf-bart",
    "BartConfig",
    "BartForConditionalGeneration",
    "learned positions offset by 2, post-LayerNorm with an embedding LayerNorm, cross-attention",
)
seq2seq(
    "hf-marian",
    "MarianConfig",
    "MarianMTModel",
    "fixed sinusoidal positions, embeddings scaled by sqrt(d), a final logits bias buffer",
    scale_embedding=True,
)

# CNNs with BatchNorm (8 images of 3 x 32 x 32, 10 classes)
cnn(
    "hf-resnet",
    "ResNetConfig",
    "ResNetForImageClassification",
    "BatchNorm, residual blocks with strided 1x1 projection shortcuts, max-pool stem",
    embedding_size=16,
    hidden_sizes=[16, 32, 64, 64],
    depths=[1, 1, 1, 1],
    layer_type="basic",
)
cnn(
    "hf-regnet",
    "RegNetConfig",
    "RegNetForImageClassification",
    "grouped 3x3 convolutions (8 channels a group) in bottleneck blocks, BatchNorm",
    embedding_size=16,
    hidden_sizes=[16, 32, 64, 64],
    depths=[1, 1, 1, 1],
    groups_width=8,
    layer_type="x",
)

# mixtures of experts (4 routed experts, top-2, no auxiliary loss)
moe("hf-mixtral", "MixtralConfig", "MixtralForCausalLM", "softmax top-2 router over 4 SwiGLU experts")
moe(
    "hf-qwen2-moe",
    "Qwen2MoeConfig",
    "Qwen2MoeForCausalLM",
    "routed experts plus a shared expert scaled by a sigmoid gate, qkv bias",
)
moe(
    "hf-qwen3-moe",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "top-2 weights renormalized to sum to one, qk-norm attention",
    head_dim=16,
    norm_topk_prob=True,
)
moe(
    "hf-phimoe",
    "PhimoeConfig",
    "PhimoeForCausalLM",
    "sampled routing: a Gumbel draw (empty_like(scores).exponential_()) picks each token's experts in training",
)
moe("hf-olmoe", "OlmoeConfig", "OlmoeForCausalLM", "RMSNorm over the whole q and k projections, softmax top-2")
moe(
    "hf-deepseek-v3",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "latent (low-rank) attention, sigmoid group-limited routing with a bias, shared expert, dense first layer",
    **DEEPSEEK_V3_TINY,
)
moe(
    "hf-granite-moe",
    "GraniteMoeConfig",
    "GraniteMoeForCausalLM",
    "scalar multipliers on embeddings, residual branches, attention scores and logits",
    embedding_multiplier=4.0,
    residual_multiplier=0.5,
    attention_multiplier=0.25,
    logits_scaling=2.0,
)

# hybrids and state-space models
decoder(
    "hf-mamba",
    "MambaConfig",
    "MambaForCausalLM",
    "selective state-space scan run token by token, depthwise causal convolution, no attention",
    kind="hybrid",
    traits=SCAN,
    state_size=8,
    use_mambapy=False,
)
moe(
    "hf-jamba",
    "JambaConfig",
    "JambaForCausalLM",
    "Mamba layers around one attention layer, experts on every other layer",
    kind="hybrid",
    attn_layer_period=4,
    attn_layer_offset=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    mamba_d_state=8,
    use_mamba_kernels=False,
)
decoder(
    "hf-bamba",
    "BambaConfig",
    "BambaForCausalLM",
    "Mamba2 layers (chunked state-space duality scan) with attention on two layers",
    kind="hybrid",
    attn_layer_indices=[1, 3],
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_chunk_size=8,
)
decoder(
    "hf-lfm2",
    "Lfm2Config",
    "Lfm2ForCausalLM",
    "gated short causal convolutions alternating with qk-norm attention",
    kind="hybrid",
    layer_types=["conv", "full_attention", "conv", "full_attention"],
    block_auto_adjust_ff_dim=False,
)
