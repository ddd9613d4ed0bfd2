"""The slice of the matrix the test suite runs (``tests/dist/test_corpus.py``, ``meshfold corpus
--slice ci``): every plan family at least once, on transformers' families, our scripts and the
generated models of the default seed, and every cell a fixed bug showed in. Each is expected
``equal``; ``REFUSED`` are the cells expected refused, with a phrase their message must hold."""

from __future__ import annotations

CI_SLICE: tuple[tuple[str, str], ...] = (
    # NOTE: a parallel-residual block's two output biases get one gradient sum, which pipelines scaled
    # per microbatch in place twice
    ("hf-gpt-neox", "pp-1f1b-fsdp"),
    ("hf-phi", "pp-gpipe-ddp"),
    # NOTE: StableLM's per-head qk norms are a list longer than its layer stack
    ("hf-stablelm", "pp-zero-bubble-tp"),
    # NOTE: layers in an nn.ModuleDict, a complex64 RoPE table, experts folded from an nn.ModuleList
    ("gen-0-4", "pp-interleaved-fsdp"),
    ("gen-0-4", "fsdp+tp"),
    ("gen-0-4", "mem-offload"),
    ("gen-0-4", "cp-ring"),
    # NOTE: a parallel residual's two dropouts keep their order through the schedule
    ("gen-0-3", "cp-ring"),
    # NOTE: the model returns (logits, loss): a pipeline trains on the loss
    ("script-nanogpt", "pp-zero-bubble-ddp"),
    ("gen-0-2", "ep"),
    # NOTE: PhiMoE's router samples its experts with exponential_(): every rank draws the whole tensor
    ("hf-phimoe", "ep"),
    ("gen-0-0", "mem-selective"),
    ("hf-bert", "ddp"),
    ("hf-t5", "fsdp"),
    ("hf-qwen3", "tp"),
    ("hf-mixtral", "fsdp+tp"),
    ("hf-llama", "auto"),
    ("hf-gemma2", "mem-full"),
    ("hf-mistral", "mem-kv"),
    ("hf-llama", "cp-tokenring"),
    ("hf-qwen2", "cp-ulysses"),
    ("hf-resnet", "fsdp"),
    # NOTE: BatchNorm reads the running statistics it updates: never recomputed
    ("script-resnet-bn", "mem-full"),
    ("hf-mamba", "ddp"),
    ("script-vit", "fsdp+tp"),
    ("script-nanogpt", "inductor"),
)

REFUSED: tuple[tuple[str, str, str], ...] = (
    ("gen-0-3", "pp-1f1b-tp", "draws random numbers"),
    ("hf-resnet", "pp-1f1b-fsdp", "updates buffers in place"),
)
