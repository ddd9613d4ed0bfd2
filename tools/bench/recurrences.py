"""Linear recurrences with the sequence split over ranks: HF Mamba (a causal convolution, then its
selective scan token by token) on one long sequence, on gloo ranks against one device.

    python -m meshfold.tools.bench.recurrences                 # seq 1024 on 1, 2 and 4 ranks
    python -m meshfold.tools.bench.recurrences --seq 2048 --steps 3

The model is ``hf-mamba``'s (``--hidden`` wide, 2 layers, state 8). Capture folds each layer's loop
over tokens into one ``meshfold.affine_scan`` and its convolution into one ``meshfold.causal_conv1d``;
under ``plan="cp"`` with the greedy sharding choice the sequence stays split through both (each
convolution takes 3 positions from the rank before, each scan one all-gather of the ranks' composite
steps). Figures are printed, never asserted:

1. Step time: the median forward + backward after a warm-up step, compiled for 1 and ``--world``
   ranks (one thread each), and the plain model in this process (one thread, HF's own loop over the
   tokens, autograd through every step), both baselines measured in the same run: the ratios to the
   eager model and to the compiled program on one rank (the fold alone, nothing split), the load
   average and the loss against the eager one's.
2. Memory: the measured peak of one forward + backward (the CPU allocator's own count of bytes above
   what was live before it, the largest over the ranks), its ratios to the same two and ``1/cp``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from meshfold.tools.bench.eager_vs_dtensor import Config, gloo_rank, spawn_ranks
from meshfold.tools.measure import one_thread, peak_new_bytes, timed_steps, train_step


def build(seq: int, hidden: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """``hf-mamba``'s model, ``hidden`` wide, on one seeded sequence of ``seq`` tokens."""
    from meshfold.tools.zoo.hf_zoo import hf_mamba

    model, _ = hf_mamba(hidden)
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone())


def _placements(graph: Any) -> list[str]:
    """How the forward scans and convolutions are laid out on ``cp``."""
    return sorted(
        {
            f"{op.name.split('.')[-1]} {op.operands[0].layout.placement('cp')}"
            for op in graph.ops
            if op.prov.phase == "fwd" and op.name in ("meshfold.affine_scan", "meshfold.causal_conv1d")
        }
    )


def _rank_main(rank: int, world: int, port: int, _cfg: dict[str, Any], opts: dict[str, Any], queue: Any) -> None:
    with gloo_rank(rank, world, port):
        from torch.distributed.device_mesh import init_device_mesh

        from meshfold import DEFAULT_PIPELINE
        from meshfold.api import parallelize

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        model, inputs = build(opts["seq"], opts["hidden"])
        t0 = time.perf_counter()
        greedy = DEFAULT_PIPELINE.replace("sharding", "sharding{mode=greedy}")
        pm = parallelize(model, mesh, inputs, plan="cp", pipeline=greedy)
        out: dict[str, Any] = {"compile_s": time.perf_counter() - t0, "placements": _placements(pm.graph())}
        times, loss = timed_steps(pm, inputs, opts["steps"], barrier=True)
        peak = torch.tensor([peak_new_bytes(lambda: train_step(pm, inputs))], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out |= {"times": times, "loss": loss, "peak": float(peak)}
        if rank == 0:
            queue.put(out)


def _baseline(seq: int, hidden: int, steps: int) -> dict[str, Any]:
    with one_thread():
        model, inputs = build(seq, hidden)
        times, loss = timed_steps(model, inputs, steps, barrier=False)
        return {"times": times, "loss": loss, "peak": float(peak_new_bytes(lambda: train_step(model, inputs)))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=1024, help="tokens of the one sequence")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--world", type=int, action="append", help="gloo ranks (the cp size); default 2 and 4")
    args = ap.parse_args(argv)
    worlds = sorted(set(args.world or [2, 4]) | {1})
    print(f"hf-mamba, hidden {args.hidden}, 2 layers, state 8; one sequence of {args.seq} tokens")
    base = _baseline(args.seq, args.hidden, args.steps)
    t0, m0 = statistics.median(base["times"]), base["peak"]
    ratios = f"{'/eager':>6} {'/cp=1':>6}"
    print(f"{'run':<11} {'median s':>8} {ratios} {'peak MiB':>8} {ratios} {'1/cp':>5} {'load':>5}  loss")
    print(f"{'eager':<11} {t0:>8.3f} {1:>6.2f} {'':>6} {m0 / 2**20:>8.1f} {1:>6.3f} {'':>6} {'':>5} ", end="")
    print(f"{os.getloadavg()[0]:>5.2f}  {base['loss']:.6f}")
    t1 = m1 = 0.0
    for world in worlds:
        opts = {"seq": args.seq, "hidden": args.hidden, "steps": args.steps}
        got = spawn_ranks(_rank_main, world, Config(), opts)
        t, m = statistics.median(got["times"]), got["peak"]
        t1, m1 = (t, m) if world == 1 else (t1, m1)
        print(
            f"{'cp=' + str(world):<11} {t:>8.3f} {t / t0:>6.2f} {t / t1:>6.2f} {m / 2**20:>8.1f} {m / m0:>6.3f} "
            f"{m / m1:>6.3f} {1 / world:>5.2f} {os.getloadavg()[0]:>5.2f}  {got['loss']:.6f} "
            f"({got['loss'] - base['loss']:+.1e}; compiled in {got['compile_s']:.1f} s); {', '.join(got['placements'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
