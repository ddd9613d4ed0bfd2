"""Eager against Inductor on gloo ranks: the same model and plan, each rank's programs run op by op
or compiled to C++ kernels (``backends/inductor.py``).

    python -m meshfold.tools.bench.backends                 # dp=2 x tp=2, fsdp+tp
    python -m meshfold.tools.bench.backends --hidden 512 --steps 10 --repeat 2

The bench's Llama-style model (``eager_vs_dtensor.BenchLlama``) is compiled by ``parallelize`` under
each backend in turn on 4 ranks. Per backend: the seconds ``parallelize`` took, the seconds Inductor
took to compile the forward and backward programs on their first call (rank 0), the median step
time after the warm-up steps (forward, backward and AdamW; the slowest rank's), and the losses of
every step against the eager backend's. Then the ratio of the step times. Four ranks share this
machine's cores: the load average is printed beside each figure, and ``--repeat`` runs the pair
again (eager first each time) so a ratio is seen more than once before it is believed. Inductor
caches what it compiled (``TORCHINDUCTOR_CACHE_DIR``): a second run of the bench compiles less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from meshfold.tools.bench.eager_vs_dtensor import Config, build, gloo_rank, spawn_ranks

BACKENDS = ("eager", "inductor")


def _rank_main(rank: int, world: int, port: int, cfg_dict: dict[str, Any], opts: dict[str, Any], queue: Any) -> None:
    with gloo_rank(rank, world, port):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from meshfold.api import parallelize
        from meshfold.passes.sharding.ilp.milp import forget

        cfg = Config(**cfg_dict)
        mesh = init_device_mesh("cpu", tuple(opts["mesh"]), mesh_dim_names=("dp", "tp"))
        rows = []
        for backend in BACKENDS:
            model, inputs = build(cfg)
            forget()  # NOTE: each backend's compile solves its plan, as in a fresh process
            dist.barrier()
            start = time.perf_counter()
            pm = parallelize(model, mesh, inputs, plan=opts["plan"], backend=backend)
            compile_s = time.perf_counter() - start
            opt = torch.optim.AdamW(pm.parameters(), lr=cfg.lr)
            losses, times = [], []
            for step in range(cfg.warmup + cfg.steps):
                dist.barrier()
                start = time.perf_counter()
                opt.zero_grad()
                loss = pm(*inputs)
                loss.backward()
                opt.step()
                took = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # NOTE: a step is as slow as its slowest rank
                losses.append(float(loss))
                if step >= cfg.warmup:
                    times.append(float(took))
            low = pm._mf_programs.first.lowered
            inductor_s = sum(getattr(m, "seconds", 0.0) for m in (low.forward, low.backward))
            rows.append(
                {
                    "backend": backend,
                    "parallelize": compile_s,
                    "inductor": inductor_s,
                    "step": statistics.median(times),
                    "losses": losses,
                    "load": os.getloadavg()[0],
                }
            )
        if rank == 0:
            queue.put(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--plan", default="fsdp+tp")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    cfg = Config(
        layers=args.layers,
        hidden=args.hidden,
        intermediate=4 * args.hidden,
        seq=args.seq,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
    )
    print(
        f"4 gloo ranks, dp=2 x tp=2, plan {args.plan}; {args.layers} layers, hidden {args.hidden}, "
        f"batch {args.batch} x seq {args.seq}"
    )
    print(
        f"{'backend':<9} {'parallelize s':>13} {'inductor s':>10} {'step s':>8} {'max |loss - eager|':>18} {'load':>5}"
    )
    worst = 0.0
    for _ in range(args.repeat):
        rows = spawn_ranks(_rank_main, 4, cfg, {"mesh": (2, 2), "plan": args.plan})
        eager = rows[0]
        for r in rows:
            diff = max(abs(a - b) for a, b in zip(r["losses"], eager["losses"], strict=True))
            worst = max(worst, diff)
            print(
                f"{r['backend']:<9} {r['parallelize']:>13.2f} {r['inductor']:>10.2f} {r['step']:>8.4f} "
                f"{diff:>18.2e} {r['load']:>5.2f}"
            )
        print(f"inductor step / eager step: {rows[1]['step'] / eager['step']:.2f} (load {os.getloadavg()[0]:.2f})")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
