"""The slice of the matrix the test suite runs (``tests/dist/test_corpus.py``, ``meshfold corpus
--slice ci``): every plan family at least once, on three or more architectures, the generated
models with the default seed, and every cell a fixed bug showed in."""

from __future__ import annotations

CI_SLICE: tuple[tuple[str, str], ...] = (
    # NOTE: a parallel-residual block's two output biases share one gradient sum (pipelines scale it per
    # microbatch in place)
    ("hf-gpt-neox", "pp-1f1b-fsdp"),
    ("hf-phi", "pp-gpipe-ddp"),
    # NOTE: StableLM's per-head qk norms are a list longer than its layer stack
    ("hf-stablelm", "pp-1f1b-tp"),
)
