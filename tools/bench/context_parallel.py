"""Context parallelism: ring attention, TokenRing and Ulysses on gloo ranks, and the simulator at 128K.

    python -m meshfold.tools.bench.context_parallel                      # time at seq 2048, memory at 8192
    python -m meshfold.tools.bench.context_parallel --seq 512 --memory-seq 2048 --steps 3

The model is ``eager_vs_dtensor``'s Llama-style one (GQA, RoPE, SwiGLU; the kernel called causal)
on ONE sequence, so only the sequence can be split. Figures are printed, never asserted:

1. Step time: the model compiled for ``--world`` gloo ranks (one thread each) under ``plan="cp"``
   with ``cp={"method": m}`` for ``ring`` and ``tokenring`` (each written as its steps, and as one
   kernel: ``METHODS``) and ``ulysses``, and the plain model in this process (one
   thread) as the baseline measured in the same run: the median forward + backward after a
   warm-up step, its ratio to the baseline, the load average, how the compiled program's attention
   reads its queries (``sequence`` for ring attention and TokenRing, ``heads`` for Ulysses) and the loss
   against the baseline's.
2. Memory: at ``--memory-seq`` the measured peak of one forward + backward (the CPU allocator's
   own count of bytes above what was live before it, the largest over the ranks) on 1 (the plain
   model), 2 and 4 ranks under ring attention and TokenRing (each as steps and as one kernel), and
   its ratio to one device's beside ``1/cp``.
   Parameters and gradients are the same on every rank (cp splits the tokens only), so the
   activations are what shrink.
3. The simulator: a Llama3-8B-shaped model at 131,072 tokens per sequence on H100 and Ascend 910C
   clusters of 16 devices (two nodes), cp 8 and 16 (data parallel over the rest, FSDP, full
   recompute), for ring attention, TokenRing and Ulysses: step time, MFU, and the time the step
   waits on the cp traffic.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from meshfold.ir.dialects.ring import first_step
from meshfold.passes.options import DEFAULT_PIPELINE
from meshfold.tools.bench.eager_vs_dtensor import Config, build, gloo_rank, spawn_ranks
from meshfold.tools.measure import one_thread, peak_new_bytes, timed_steps, train_step

METHODS = ("ring", "ring-kernel", "tokenring", "tokenring-kernel", "ulysses")
"""``ring``, ``tokenring``: written as their steps (``passes/cp/steps.py``: the passes are ops of the
program, scheduled by ``overlap``); ``-kernel``: the same, run as one kernel that passes them
itself (the pipeline without ``ring-steps``)."""
KERNEL_PIPELINE = DEFAULT_PIPELINE.replace("ring-steps,", "")
SIM_METHODS = ("ring", "tokenring", "ulysses")


def _splits(graph: Any) -> list[str]:
    """How each forward attention of ``graph`` reads its queries on the ``cp`` axis."""
    out = []
    for op in graph.ops:
        if ("scaled_dot_product" in op.name or first_step(op)) and op.prov.phase == "fwd":
            q = op.operands[0]
            dim = getattr(q.layout.placement("cp"), "dim", None)
            out.append({q.type.rank - 2: "sequence", 1: "heads", 0: "batch"}.get(dim, "whole"))
    return sorted(set(out))


def _rank_main(rank: int, world: int, port: int, cfg_dict: dict[str, Any], opts: dict[str, Any], queue: Any) -> None:
    with gloo_rank(rank, world, port):
        from torch.distributed.device_mesh import init_device_mesh

        from meshfold.api import parallelize

        cfg = Config(**cfg_dict)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        model, inputs = build(cfg)
        t0 = time.perf_counter()
        method, kernel = opts["method"].removesuffix("-kernel"), opts["method"].endswith("-kernel")
        pipeline = KERNEL_PIPELINE if kernel else DEFAULT_PIPELINE
        pm = parallelize(model, mesh, inputs, plan="cp", cp={"method": method}, pipeline=pipeline)
        compile_s = time.perf_counter() - t0
        out: dict[str, Any] = {"compile_s": compile_s, "splits": _splits(pm.graph())}
        if opts["memory"]:
            train_step(pm, inputs)
            peak = torch.tensor([peak_new_bytes(lambda: train_step(pm, inputs))], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out["peak"] = float(peak)
        else:
            times, loss = timed_steps(pm, inputs, opts["steps"], barrier=True)
            out |= {"times": times, "loss": loss}
        if rank == 0:
            queue.put(out)


def _baseline(cfg: Config, steps: int, memory: bool) -> dict[str, Any]:
    """The plain model in this process, one thread: step times and loss, or the step's peak."""
    with one_thread():
        model, inputs = build(cfg)
        if memory:
            train_step(model, inputs)
            return {"peak": float(peak_new_bytes(lambda: train_step(model, inputs)))}
        times, loss = timed_steps(model, inputs, steps, barrier=False)
        return {"times": times, "loss": loss}


def measured(cfg: Config, world: int, steps: int) -> None:
    """Part 1: step time of each method against one device."""
    print(f"\n== step time: one sequence of {cfg.seq} tokens, {world} gloo ranks (cp={world}), one thread each")
    base = _baseline(cfg, steps, memory=False)
    t1 = statistics.median(base["times"])
    print(f"{'run':<22} {'median s':>9} {'ratio':>7} {'load':>5}  attention   loss (vs one device)")
    print(f"{'one device':<22} {t1:>9.3f} {1.0:>7.2f} {os.getloadavg()[0]:>5.2f}  -           {base['loss']:.6f}")
    for method in METHODS:
        got = spawn_ranks(_rank_main, world, cfg, {"method": method, "steps": steps, "memory": False})
        t = statistics.median(got["times"])
        diff = got["loss"] - base["loss"]
        print(
            f"{'cp=' + str(world) + ' ' + method:<22} {t:>9.3f} {t / t1:>7.2f} {os.getloadavg()[0]:>5.2f}  "
            f"{','.join(got['splits']):<11} {got['loss']:.6f} ({diff:+.1e}; compiled in {got['compile_s']:.1f} s)"
        )


def memory(cfg: Config, worlds: tuple[int, ...]) -> None:
    """Part 2: peak bytes of one step per rank against one device, ring attention and TokenRing each as
    steps and as one kernel."""
    print(f"\n== memory: one sequence of {cfg.seq} tokens, peak of one forward + backward per rank")
    base = _baseline(cfg, 1, memory=True)["peak"]
    print(f"{'ranks':<8} {'attention':<22} {'peak MiB':>9} {'ratio':>7} {'1/cp':>6} {'load':>5}")
    print(f"{1:<8} {'-':<22} {base / 2**20:>9.1f} {1.0:>7.3f} {1.0:>6.3f} {os.getloadavg()[0]:>5.2f}")
    for world in worlds:
        for method in ("ring", "ring-kernel", "tokenring", "tokenring-kernel"):
            got = spawn_ranks(_rank_main, world, cfg, {"method": method, "steps": 0, "memory": True})
            peak = got["peak"]
            how = method.replace("-kernel", ", one kernel") if method.endswith("-kernel") else f"{method}, steps"
            load = os.getloadavg()[0]
            print(f"{world:<8} {how:<22} {peak / 2**20:>9.1f} {peak / base:>7.3f} {1 / world:>6.3f} {load:>5.2f}")


def simulated() -> None:
    """Part 3: the simulator's view of a Llama3-8B shape at 128K tokens."""
    from meshfold.sim import ParallelConfig, TrainSpec, parse_cluster, preset, simulate
    from meshfold.sim.parallel import ConfigError

    model, seq, batch = preset("llama3-8b"), 131072, 16
    print(f"\n== simulator: {model.name} at {seq} tokens per sequence, global batch {batch}, FSDP, full recompute")
    print(f"{'cluster':<16} {'cp':>3} {'method':<10} {'step s':>8} {'MFU':>6} {'cp wait s':>10}")
    for cluster in ("h100:8x2", "ascend910c:8x2"):
        c = parse_cluster(cluster)
        for cp in (8, 16):
            for method in SIM_METHODS:
                cfg = ParallelConfig(dp=c.world_size // cp, cp=cp, zero=3, recompute="full", cp_method=method)
                try:
                    r = simulate(model, c, cfg, TrainSpec(seq, batch), timeline=False)
                except ConfigError as e:
                    print(f"{cluster:<16} {cp:>3} {method:<10} {e}")
                    continue
                wait = dict(r.breakdown)["tp/cp/ep exposed"]  # NOTE: tp=1 and no experts: all of it is cp's
                print(f"{cluster:<16} {cp:>3} {method:<10} {r.step_time_s:>8.2f} {r.mfu:>6.3f} {wait:>10.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="gloo ranks of the step-time runs (the cp size)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens of the step-time runs' one sequence")
    ap.add_argument("--memory-seq", type=int, default=8192, help="tokens of the memory runs' one sequence")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--skip", choices=("time", "memory", "simulator"), action="append", default=[])
    args = ap.parse_args(argv)
    base = Config(hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4, batch=1)
    print(f"model: hidden {base.hidden}, {base.layers} layers, {base.heads} heads ({base.kv_heads} of keys/values)")
    if "time" not in args.skip:
        measured(dataclasses.replace(base, seq=args.seq), args.world, args.steps)
    if "memory" not in args.skip:
        memory(dataclasses.replace(base, seq=args.memory_seq), (2, 4))
    if "simulator" not in args.skip:
        simulated()
    return 0


if __name__ == "__main__":
    sys.exit(main())
