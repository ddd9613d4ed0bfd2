"""Capture time and peak host memory for HF Llama at Llama3-8B dimensions on fake tensors.

    python -m meshfold.tools.bench.compile_time.capture_scale --layers 32 --seq 2048

Weights are never allocated: the model is built under a ``FakeTensorMode``. Prints the joint
graph's op count, capture and print times, and the process's peak RSS against the bytes the
parameters would take if they were real (the baseline this run proves we avoid). Then, ``--repeat``
times, the capture with every layer traced (``fold=False``) beside the default one that traces each
run of identical layers once: their time ratio, and whether the two programs are the same.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from meshfold import capture
from meshfold.ir.graph import first_difference


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> None:
    """Build Llama3-8B-shaped HF Llama under fake tensors, capture it, print the figures."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="folded/whole capture pairs timed after the first capture")
    args = ap.parse_args(argv)

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        attn_implementation="sdpa",
    )

    class Wrapped(LlamaForCausalLM):  # type: ignore[misc]
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(input_ids=input_ids, labels=labels, use_cache=False).loss

    rss0 = _peak_rss_bytes()
    t0 = time.perf_counter()
    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        model = Wrapped(cfg)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    t1 = time.perf_counter()
    graph = capture(model, (ids, ids))
    t2 = time.perf_counter()
    text = str(graph)
    t3 = time.perf_counter()
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = n_params * 4
    peak = _peak_rss_bytes()
    print(f"model           Llama3-8B dims, {args.layers} layers, batch {args.batch}, seq {args.seq}")
    print(f"parameters      {n_params / 1e9:.2f} B ({param_bytes / 2**30:.1f} GiB if allocated in fp32)")
    print(f"joint graph     {len(graph.ops)} ops, {len(text.splitlines())} lines of IR text")
    print(f"build (fake)    {t1 - t0:.1f} s")
    print(f"capture         {t2 - t1:.1f} s (load {os.getloadavg()[0]:.2f})")
    print(f"print           {t3 - t2:.1f} s")
    print(f"peak RSS        {peak / 2**30:.2f} GiB (at start {rss0 / 2**30:.2f} GiB)")
    print(f"ratio           peak RSS / fp32 parameter bytes = {peak / param_bytes:.3f}")
    for _ in range(args.repeat):
        # NOTE: the baseline, in this run: every layer traced (capture(fold=False)), then folded again
        t4 = time.perf_counter()
        whole = capture(model, (ids, ids), fold=False)
        t5 = time.perf_counter()
        folded = capture(model, (ids, ids))
        t6 = time.perf_counter()
        same = first_difference(folded, whole)
        print(
            f"fold vs whole   {t6 - t5:.1f} s folded, {t5 - t4:.1f} s every layer traced: ratio "
            f"{(t6 - t5) / (t5 - t4):.3f} (load {os.getloadavg()[0]:.2f}); "
            f"{'the same program' if same is None else 'programs differ: ' + same}"
        )


if __name__ == "__main__":
    main()
