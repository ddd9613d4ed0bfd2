"""Pipeline schedules on gloo ranks: each schedule's step time and measured bubble beside its theoretical one.

    python -m meshfold.tools.bench.pp_schedules                      # 4 ranks on pp, 8 layers
    python -m meshfold.tools.bench.pp_schedules --microbatches 4 8 --steps 5

The bench's Llama-style model (``eager_vs_dtensor.BenchLlama``) is pipelined over ``pp=4`` under GPipe,
1F1B, interleaved 1F1B (two stages per rank) and zero bubble (ZB-H1: one stage per rank, each
backward's weight gradients run apart, later) for each microbatch count, and under ``schedule="auto"``
(the schedule the time model predicts fastest, ``meshfold.pp.stage_split.plan_pipeline``). Per schedule:
the median step time beside the time model's prediction, and the bubble as measured: the share of
a step's wall time a rank's stage programs did not run (waiting for the other stages, sends and
receives included), the mean over ranks, beside
``(p - 1) / (v m + p - 1)``. Four ranks share this machine's cores, so a rank's programs also wait
for a core; the load average is printed beside each row. The first step's loss is checked against
the single-device model on the whole batch. Last, per microbatch count: the schedule auto chose,
the measured fastest, and auto's measured step over the fastest's (1.00: auto chose the fastest).
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch

from meshfold.tools.bench.eager_vs_dtensor import Config, build, gloo_rank, spawn_ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")


def _rank_main(rank: int, world: int, port: int, cfg_dict: dict[str, Any], opts: dict[str, Any], queue: Any) -> None:
    with gloo_rank(rank, world, port):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from meshfold.api import parallelize

        cfg = Config(**cfg_dict)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
        rows = []
        for micro in opts["microbatches"]:
            for schedule in (*SCHEDULES, "auto"):
                model, inputs = build(cfg)
                pm = parallelize(model, mesh, inputs, plan="pp", pp={"schedule": schedule, "microbatches": micro})
                chosen = pm.spec.label
                times, bubbles, losses = [], [], []
                for step in range(opts["warmup"] + opts["steps"]):
                    dist.barrier()
                    loss = pm.step(*inputs)
                    losses.append(float(loss))
                    if step >= opts["warmup"]:
                        times.append(pm.last_step.seconds)
                        bubbles.append(pm.last_step.bubble)
                    for p in pm.parameters():
                        p.grad = None
                mine = statistics.mean(bubbles)
                every: list[Any] = [None] * world
                dist.all_gather_object(every, mine)
                rows.append(
                    {
                        "schedule": schedule,
                        "chosen": chosen,
                        "predicted": pm.plan.step_s,
                        "microbatches": micro,
                        "seconds": statistics.median(times),
                        "bubble": statistics.mean(every),
                        "theory": pm.spec.bubble(),
                        "loss": losses[0],
                        "load": os.getloadavg()[0],
                    }
                )
        if rank == 0:
            queue.put(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    batch = 2 * max(args.microbatches)
    cfg = Config(layers=args.layers, hidden=args.hidden, intermediate=4 * args.hidden, seq=args.seq, batch=batch)
    model, inputs = build(cfg)
    with torch.no_grad():
        want = float(model(*inputs))
    opts = {"microbatches": args.microbatches, "steps": args.steps, "warmup": args.warmup}
    rows = spawn_ranks(_rank_main, args.ranks, cfg, opts)
    print(f"pp={args.ranks}, {args.layers} layers, hidden {args.hidden}, batch {batch} x seq {args.seq}")
    head = ("schedule", "micro", "step s", "predicted", "bubble", "theory", "loss - 1 device", "load")
    print(f"{head[0]:<20} {head[1]:>5} {head[2]:>8} {head[3]:>9} {head[4]:>7} {head[5]:>7} {head[6]:>16} {head[7]:>5}")
    worst = 0.0
    for r in rows:
        diff = r["loss"] - want
        worst = max(worst, abs(diff))
        name = r["schedule"] if r["schedule"] != "auto" else f"auto: {r['chosen']}"
        print(
            f"{name:<20} {r['microbatches']:>5} {r['seconds']:>8.3f} {r['predicted']:>9.3f} {r['bubble']:>7.3f} "
            f"{r['theory']:>7.3f} {diff:>16.2e} {r['load']:>5.2f}"
        )
    for micro in args.microbatches:
        fixed = [r for r in rows if r["microbatches"] == micro and r["schedule"] != "auto"]
        auto = next(r for r in rows if r["microbatches"] == micro and r["schedule"] == "auto")
        fastest = min(fixed, key=lambda r: r["seconds"])
        print(
            f"{micro} microbatches: auto chose {auto['chosen']}, measured fastest {fastest['chosen']}; auto's step "
            f"{auto['seconds'] / fastest['seconds']:.2f}x the fastest's (load {os.getloadavg()[0]:.2f})"
        )
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
