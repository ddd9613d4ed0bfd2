"""Capture and ``plan="auto"`` sharding at real model sizes, on fake tensors (nothing allocated).

    python -m meshfold.tools.bench.compile_time.solve_scale            # every case, each in a fresh process
    python -m meshfold.tools.bench.compile_time.solve_scale --case llama-32
    python -m meshfold.tools.bench.compile_time.solve_scale --case llama-32 --case llama70b-80 --pairs 3

Cases: HF Llama at Llama3-8B dimensions with 2, 8 and 32 layers and at Llama3-70B dimensions
with 80 layers (seq 2048, global batch 16), and DeepSeek-V3-shaped MoE at 8 layers (3 dense,
then 256 routed experts, top 8), whose expert split ``auto`` chooses itself; all on ``dp=8,tp=8``
of h100:8x8.

Per case: capture and whole-pipeline wall time (the default pipeline ``parallelize`` runs, the
verifier included) and each pass's share of it, each mesh axis's program (binaries, columns, rows), its
gap and nodes, peak RSS, and the modelled step time of the ``auto`` plan against the preset the
mesh names (``fsdp+tp``) priced by the same program (a parameter the preset stores sharded pays
for its gathers). The load average is printed beside each row; the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import nullcontext
from typing import Any

CASES = {
    "llama-2": ("llama", 2),
    "llama-8": ("llama", 8),
    "llama-32": ("llama", 32),
    "llama70b-80": ("llama70b", 80),
    "deepseek-v3-8": ("deepseek", 8),
}


def _model(kind: str, layers: int) -> Any:
    import transformers as hf

    if kind == "deepseek":
        cfg = hf.DeepseekV3Config(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=layers,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_shared_experts=1,
            n_group=8,
            topk_group=4,
            first_k_dense_replace=3,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            attn_implementation="sdpa",
        )
        base: Any = hf.DeepseekV3ForCausalLM
    else:
        big = kind == "llama70b"
        cfg = hf.LlamaConfig(
            vocab_size=128256,
            hidden_size=8192 if big else 4096,
            intermediate_size=28672 if big else 14336,
            num_hidden_layers=layers,
            num_attention_heads=64 if big else 32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            attn_implementation="sdpa",
        )
        base = hf.LlamaForCausalLM

    class Loss(base):  # type: ignore[misc, valid-type]
        def forward(self, input_ids: Any, labels: Any) -> Any:  # type: ignore[override]
            return super().forward(input_ids=input_ids, labels=labels, use_cache=False).loss

    return Loss(cfg), cfg.vocab_size


def run_case(name: str) -> dict[str, Any]:
    """Capture and shard one case in this process; the figures as a dict."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from meshfold import capture
    from meshfold.passes.options import DEFAULT_PIPELINE, Options
    from meshfold.session import compile_model

    kind, layers = CASES[name]
    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        model, vocab = _model(kind, layers)
        ids = torch.randint(0, vocab, (16, 2048))
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, (ids, ids))
        t1 = time.perf_counter()
        opts = Options.of(mesh="dp=8,tp=8", plan="auto", cluster="h100:8x8", pipeline=DEFAULT_PIPELINE)
        result = compile_model(graph, None, opts, status=lambda _m: nullcontext())
    t2 = time.perf_counter()
    stats = result.stats
    preset = stats.get("sharding.preset")
    return {
        "case": name,
        "ops": len(graph.ops),
        "capture_s": t1 - t0,
        "pipeline_s": t2 - t1,
        "axes": [
            {
                "axis": s.axis,
                "binaries": s.binaries,
                "columns": s.columns,
                "rows": s.rows,
                "gap": s.gap,
                "optimal": s.optimal,
                "nodes": s.nodes,
            }
            for s in stats["sharding.solve"]  # type: ignore[attr-defined]
        ],
        "passes": {t.name: t.seconds for t in result.timings if t.seconds >= 0.005},
        "auto_ms": 1e3 * float(stats["sharding.step_time"]),  # type: ignore[arg-type]
        "preset": None if preset is None else [preset[0], 1e3 * preset[1]],  # type: ignore[index]
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def _row(r: dict[str, Any], load: float) -> str:
    axes = "; ".join(
        f"{a['axis']}: {a['binaries']} bin, {a['columns']} cols, {a['rows']} rows, gap {100 * a['gap']:.2f}%"
        f"{'' if a['optimal'] else ' (node limit)'}, {a['nodes']} nodes"
        for a in r["axes"]
    )
    vs = ""
    if r["preset"] is not None:
        name, ms = r["preset"]
        vs = f"; step {r['auto_ms']:.1f} ms auto vs {ms:.1f} ms {name} (ratio {r['auto_ms'] / ms:.3f})"
    return (
        f"{r['case']:<14} {r['ops']:>6} ops  capture {r['capture_s']:5.1f} s  pipeline {r['pipeline_s']:5.1f} s  "
        f"total {r['capture_s'] + r['pipeline_s']:5.1f} s  RSS {r['peak_rss_gib']:.2f} GiB  load {load:.2f}\n"
        f"{'':<14} {axes}{vs}\n"
        f"{'':<14} passes: {', '.join(f'{k} {v:.2f} s' for k, v in r['passes'].items())}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(CASES), action="append", help="run only these cases")
    ap.add_argument("--json", action="store_true", help="print one case's figures as JSON (used by the runner)")
    ap.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="run the 32- and 80-layer cases this many times in turn and print each pair's ratio and their median",
    )
    args = ap.parse_args(argv)
    if args.json:
        for name in args.case or []:
            print(json.dumps(run_case(name)))
        return 0
    cases = args.case or list(CASES)
    ratios: list[float] = []
    for k in range(max(args.pairs, 1)):
        figures = {}
        for name in cases if k == 0 else [c for c in cases if c in ("llama-32", "llama70b-80")]:
            got = _case(name)
            if got is None:
                return 1
            figures[name] = got
            print(_row(got, os.getloadavg()[0]), flush=True)
        if "llama-32" in figures and "llama70b-80" in figures:
            a, b = figures["llama-32"], figures["llama70b-80"]
            ratios.append((b["capture_s"] + b["pipeline_s"]) / (a["capture_s"] + a["pipeline_s"]))
            print(f"80 layers (70B dims) / 32 layers (8B dims), capture + pipeline: {ratios[-1]:.2f}x", flush=True)
    if len(ratios) > 1:
        each = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"median of {len(ratios)} pairs: {statistics.median(ratios):.2f}x ({each})")
    return 0


def _case(name: str) -> dict[str, Any] | None:
    """One case's figures, from a fresh process (None, with its error printed, if it failed)."""
    proc = subprocess.run(
        [sys.executable, "-m", "meshfold.tools.bench.compile_time.solve_scale", "--json", "--case", name],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


if __name__ == "__main__":
    raise SystemExit(main())
