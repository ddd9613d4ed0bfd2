"""meshfold with and without its ``overlap`` pass, beside two DTensor-eager baselines: step time,
exposed communication and peak memory, one run.

    python -m meshfold.tools.bench.overlap_step                                  # 4 gloo CPU ranks, (dp=2, tp=2)
    python -m meshfold.tools.bench.overlap_step --layers 2 --hidden 128 --seq 64 --steps 3
    python -m meshfold.tools.bench.overlap_step --backend inductor          # meshfold's programs compiled

Spawns ``dp * tp`` local CPU ranks (gloo, one thread each) and trains the Llama-style model of
``eager_vs_dtensor`` (same weights, inputs, global batch, AdamW) four ways, steps interleaved side by
side (one step of each, between barriers, then the next) so that drift in machine load hits all alike:

1. meshfold, ``plan="fsdp+tp"`` (``--plan``: another plan, ``auto`` for the solve's),
   ``pipeline=DEFAULT_PIPELINE`` (which schedules collectives under
   compute with its ``overlap`` pass);
2. meshfold, the same pipeline with the ``overlap`` entry removed (when the default pipeline has no
   such entry both sides run the same program, and the report says so);
3. DTensor eager as in ``eager_vs_dtensor``: ColwiseParallel / RowwiseParallel per layer over ``tp``,
   FSDP2 ``fully_shard`` per layer and root over ``dp``, no sequence parallel, LM head whole;
4. DTensor eager, torchtitan's Llama recipe: sequence-parallel RMSNorms (``SequenceParallel``), each
   attention and MLP gathering its sequence shard (``PrepareModuleInput``), o/down projections
   reduce-scattering back to it, a vocab-sharded embedding, a vocab-parallel LM head under
   ``loss_parallel``, and FSDP2 units for the embedding, each layer and ``[norm, lm_head]`` (kept
   unsharded after forward) with explicit forward and backward prefetch from unit to unit.
   The same torch.distributed calls torchtitan makes, made here (its Llama code imports triton,
   absent on CPU).

``--backend inductor`` compiles both meshfold sides' programs with Inductor (``backends/inductor.py``);
they compile on the first warm-up step, which is never timed.

Measured: the median step time (forward + backward + AdamW between barriers, after warm-up steps),
the load average sampled after each step; collectives and bytes each rank sends per step, counted
in the last warm-up step (``CommCounter``; what a backend traces while it compiles on the first call
is not counted); the CPU time each rank's process spends in a step (every thread, so gloo's workers
too), summed over the ranks: where the ranks share fewer cores than they are, a step lasts at least
that over the cores, however its communication is scheduled; for both meshfold sides,
torch.profiler on rank 0 over ``--profile-steps`` steps of each (interleaved, a barrier before
each; medians): the CPU time inside
``_c10d_functional::wait_tensor``, where a lowered program blocks (the exposed communication), the
time gloo's worker threads run collectives (``gloo:all_to_all`` ..., barriers left out; not the time
a collective queues for a worker, so exposed time can exceed it) and the CPU time issuing the
``_c10d_functional`` collectives; peak memory on every rank as the multi-rank memory tests measure
it: resident bytes (parameters, buffers, AdamW state) plus the CPU allocator's own peak over one
forward + backward (its count, so frees on gloo's threads count). The losses of every side and
step are checked against each other and a single-device run (exit 1 if they differ). Timings are
printed, never asserted; the goals are printed beside the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfold.passes import PassPipeline
from meshfold.tools.bench.eager_vs_dtensor import (
    LOSS_TOL,
    SIZES,
    Config,
    Side,
    _dtensor_model,
    _single_device,
    build,
    gloo_rank,
    optimizer_option,
    spawn_ranks,
    trainer,
)
from meshfold.tools.bench.titan_recipe import titan_model
from meshfold.tools.measure import allocator_accounting, peak_new_bytes, storage_bytes

NAMES = {"overlap": "meshfold, overlap", "no overlap": "meshfold, no overlap"}
NAMES |= {"dtensor": "DTensor FSDP2+TP", "titan": "DTensor torchtitan"}
SIDES = tuple(NAMES)
WAIT, STEP = "_c10d_functional::wait_tensor", "bench.step."  # the op lowered programs block in; a step's span
GOAL_EXPOSED, GOAL_SPEEDUP = 0.5, 1.5


def without_pass(pipeline: str, name: str) -> str:
    """``pipeline`` with its ``name`` entries (and their options) removed; unchanged if it has none."""
    passes = PassPipeline.parse(pipeline).passes
    kept = tuple(p for p in passes if p.name != name)
    return pipeline if len(kept) == len(passes) else str(PassPipeline(kept))


def llama_intermediate(hidden: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4·hidden, rounded up to a multiple of 16 (256 → 688, 512 → 1376)."""
    return 16 * math.ceil(8 * hidden / 3 / 16)


def comm_profile(steps: dict[str, Callable[[], torch.Tensor]], n: int) -> dict[str, dict[str, float]]:
    """Medians over ``n`` steps of each of ``steps`` (interleaved), from torch.profiler on rank 0: per step
    ``exposed`` (ms inside ``wait_tensor``), ``waits``, ``in_flight`` (ms of gloo collectives, barriers
    left out) and ``issue`` (ms of CPU issuing ``_c10d_functional`` collectives). Every rank calls it."""
    from torch.profiler import ProfilerActivity, profile, record_function

    on = dist.get_rank() == 0
    with profile(activities=[ProfilerActivity.CPU]) if on else contextlib.nullcontext() as prof:
        for _ in range(n):
            for label, step in steps.items():
                dist.barrier()
                with record_function(STEP + label):
                    step()
        dist.barrier()
    if prof is None:
        return {}
    events, out = list(prof.events()), {}
    for label in steps:
        per_step = []
        for start, end in [(e.time_range.start, e.time_range.end) for e in events if e.name == STEP + label]:
            inside = [e for e in events if start <= e.time_range.start < end]
            waits = [e.cpu_time_total for e in inside if e.name == WAIT]
            issued = [e.cpu_time_total for e in inside if e.name.startswith("_c10d_functional::") and e.name != WAIT]
            flying = [
                e.time_range.elapsed_us() for e in inside if e.name.startswith("gloo:") and "barrier" not in e.name
            ]
            per_step.append((sum(waits) / 1e3, len(waits), sum(flying) / 1e3, sum(issued) / 1e3))
        columns = [statistics.median(c) for c in zip(*per_step, strict=True)]
        out[label] = dict(zip(("exposed", "waits", "in_flight", "issue"), columns, strict=True))
    return out


def step_memory(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple[torch.Tensor, ...]) -> int:
    """Resident bytes of ``model``'s parameters, buffers and ``opt``'s state on this rank, plus the
    allocator's peak over one forward + backward from no gradients (one training step runs first)."""
    with allocator_accounting():
        opt.zero_grad()
        model(*inputs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        resident = storage_bytes([*model.parameters(), *model.buffers(), *states])
        return resident + peak_new_bytes(lambda: model(*inputs).backward())


def _rank_main(rank: int, world: int, port: int, cfg_dict: dict[str, Any], opts: dict[str, Any], queue: Any) -> None:
    with gloo_rank(rank, world, port):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel

        from meshfold import parallelize
        from meshfold.passes.schedule.timeline import predicted
        from meshfold.passes.sharding.ilp.milp import forget

        cfg = Config(**cfg_dict)
        mesh = init_device_mesh("cpu", tuple(opts["mesh"]), mesh_dim_names=("dp", "tp"))
        inputs = build(cfg)[1]
        dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
        local = tuple(x.chunk(dp, dim=0)[dp_rank].contiguous() for x in inputs)
        trainers: dict[str, Any] = {}
        out: dict[str, Any] = {"compile_s": {}}
        for label in ("overlap", "no overlap"):
            forget()  # NOTE: each compile solves its plan, as in a fresh process
            t0 = time.perf_counter()
            pm = parallelize(
                build(cfg)[0],
                mesh,
                inputs,
                plan=opts["plan"],
                pipeline=opts["pipelines"][label],
                backend=opts["backend"],
            )
            out["compile_s"][label] = time.perf_counter() - t0
            tl = predicted(pm.graph())  # NOTE: the time model's step and exposed communication, same program
            out.setdefault("predicted", {})[label] = (1e3 * tl.step, 1e3 * tl.exposed_total)
            trainers[label] = (pm, *trainer(pm, inputs, cfg))
        trainers["dtensor"] = (None, *trainer(_dtensor_model(build(cfg)[0], mesh, "replicate"), local, cfg))
        trainers["titan"] = (None, *trainer(titan_model(build(cfg)[0], mesh), local, cfg, loss_parallel))

        sides = {label: Side(trainers[label][1]) for label in SIDES}
        loads: dict[str, list[float]] = {label: [] for label in SIDES}
        for i in range(cfg.warmup + cfg.steps):
            for label, side in sides.items():
                side.run(count=i == cfg.warmup - 1)  # NOTE: after any first-call compile
                loads[label].append(os.getloadavg()[0])
        losses = {}
        for label, side in sides.items():
            # NOTE: each dp rank's DTensor loss is the mean over its equal share of tokens; their mean is global.
            stacked = torch.stack(side.losses)
            if label in ("dtensor", "titan"):
                dist.all_reduce(stacked, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
            losses[label] = stacked.tolist()
        cpu = {label: statistics.median(side.cpu[cfg.warmup :]) for label, side in sides.items()}
        cpu_per_rank: list[Any] = [None] * world
        dist.all_gather_object(cpu_per_rank, cpu)
        comm = comm_profile({label: trainers[label][1] for label in SIDES[:2]}, opts["profile_steps"])
        comm_load = os.getloadavg()[0]
        memory = {label: step_memory(trainers[label][0], trainers[label][2], inputs) for label in SIDES[:2]}
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, memory)
        if rank == 0:
            out |= {
                "times": {k: s.times[cfg.warmup :] for k, s in sides.items()},
                "loads": {k: v[cfg.warmup :] for k, v in loads.items()},
                "cpu": {k: sum(c[k] for c in cpu_per_rank) for k in SIDES},
                "losses": losses,
                "traced": {
                    k: (sum(s.counter.counts.values()), sum(s.counter.bytes.values())) for k, s in sides.items()
                },
                "comm": comm,
                "comm_load": comm_load,
                "memory": per_rank,
                "memory_load": os.getloadavg()[0],
            }
            queue.put(out)


def _report(cfg: Config, opts: dict[str, Any], r: dict[str, Any], ref: list[float]) -> int:
    mib, med = 2**20, {k: statistics.median(v) * 1e3 for k, v in r["times"].items()}
    n_params, (dp, tp), mf = sum(p.numel() for p in build(cfg)[0].parameters()), opts["mesh"], SIDES[:2]
    print(
        f"model: Llama-style, {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads ({cfg.kv_heads} kv), "
        f"intermediate {cfg.intermediate}, vocab {cfg.vocab}, {n_params / 1e6:.2f} M params; batch {cfg.batch} x seq "
        f"{cfg.seq}\nmesh: dp={dp} x tp={tp} ({dp * tp} gloo CPU ranks, 1 thread each); {cfg.warmup} warm-up + "
        f"{cfg.steps} timed steps per side, interleaved, AdamW ({cfg.optimizer}) lr {cfg.lr}"
    )
    for k in mf:
        print(
            f"{NAMES[k]}: plan {opts['plan']}, pipeline {opts['pipelines'][k]}, {opts['backend']} backend "
            f"(parallelize {r['compile_s'][k]:.1f} s)"
        )
    if opts["pipelines"]["overlap"] == opts["pipelines"]["no overlap"]:
        print("!!! the pipeline has no overlap pass: both meshfold sides run the same program !!!")

    w, load = max(len(n) for n in NAMES.values()), statistics.median(r["loads"]["overlap"])
    heads = ("median ms", "min / max ms", "colls/step", "MiB/rank/step", "CPU ms/step", "load")
    print(f"\n{'step time':<{w}}" + "".join(f"  {h:>13}" for h in heads))
    for k in SIDES:
        t, (n, b) = r["times"][k], r["traced"][k]
        cpu = f"{r['cpu'][k] * 1e3:.0f}"
        cells = (f"{med[k]:.1f}", f"{min(t) * 1e3:.0f} / {max(t) * 1e3:.0f}", n, f"{b / mib:.3f}", cpu)
        print(
            f"{NAMES[k]:<{w}}" + "".join(f"  {c:>13}" for c in cells) + f"  {statistics.median(r['loads'][k]):>13.2f}"
        )
    cores = len(os.sched_getaffinity(0))
    print(
        f"CPU ms/step: each rank's median CPU time per step (its process, all threads: gloo's workers too), "
        f"summed over the ranks; a step takes at least that over the {cores} cores: "
        + ", ".join(f"{NAMES[k]} {r['cpu'][k] * 1e3 / cores:.0f} ms" for k in SIDES)
    )
    best = min(("dtensor", "titan"), key=lambda k: med[k])
    print(f"\noverlap's speed-up over no overlap: {med['no overlap'] / med['overlap']:.2f}x  (load {load:.2f})")
    print(
        f"meshfold(overlap) speed-up over the faster baseline, {NAMES[best]}: {med[best] / med['overlap']:.2f}x "
        f"(goal >= {GOAL_SPEEDUP}x)  (load {load:.2f})"
    )

    c = r["comm"]
    heads = ("exposed ms", "waits", "in flight ms", "predicted ms")
    print(f"\n{'comm per step, rank 0':<{w}}" + "".join(f"  {h:>13}" for h in heads))
    for k in mf:
        step_ms, exposed_ms = r["predicted"][k]
        figures = (f"{c[k]['exposed']:.1f}", f"{c[k]['waits']:.0f}", f"{c[k]['in_flight']:.1f}", f"{exposed_ms:.1f}")
        tail = f"  (issuing: {c[k]['issue']:.1f} ms; predicted step {step_ms:.1f} ms)"
        print(f"{NAMES[k]:<{w}}" + "".join(f"  {x:>13}" for x in figures) + tail)
    ratio = c["overlap"]["exposed"] / max(c["no overlap"]["exposed"], 1e-9)
    print(f"exposed(overlap) / exposed(no overlap): {ratio:.2f} (goal <= {GOAL_EXPOSED})  (load {r['comm_load']:.2f})")

    print(f"\npeak memory per rank, MiB (resident + peak of forward + backward)  (load {r['memory_load']:.2f})")
    print("rank" + "".join(f"  {NAMES[k]:>22}" for k in mf) + "  overlap / no overlap")
    for i, m in enumerate(r["memory"]):
        print(f"{i:<4}" + "".join(f"  {m[k] / mib:>22.2f}" for k in mf) + f"  {m['overlap'] / m['no overlap']:.3f}")

    losses, names = {**r["losses"], "single": ref}, {**NAMES, "single": "single device"}
    steps = [(k, j, i) for n, k in enumerate(SIDES) for j in ("single", *SIDES[n + 1 :]) for i in range(len(ref))]
    diffs = [(abs(losses[k][i] - losses[j][i]), i, k, j, losses[k][i], losses[j][i]) for k, j, i in steps]
    single, pair = (max(d[0] for d in diffs if (d[3] == "single") == s) for s in (True, False))
    print(
        f"\nlosses: single device first {ref[0]:.6f}, step {len(ref)} {ref[-1]:.6f}; max |side - single| over all "
        f"steps {single:.1e}; max |side - side| {pair:.1e}"
    )
    # NOTE: relative (absolute below a loss of 1): fp32 sums in another order drift a few 1e-5 over steps.
    bad = [d for d in diffs if d[0] > LOSS_TOL * max(1.0, abs(d[5]))]
    if not bad:
        print(f"losses agree (rtol {LOSS_TOL:g})")
        return 0
    for _, i, k, j, a, b in bad[:8]:
        print(f"  step {i + 1}: {names[k]} loss {a:.6f} vs {names[j]} {b:.6f}")
    print(f"!!! LOSSES DISAGREE (rtol {LOSS_TOL:g}): the figures above compare different computations !!!")
    return 1


def main(argv: list[str] | None = None) -> int:
    """Parse options, spawn the ranks, run the single-device reference, print the figures."""
    from meshfold.passes.options import DEFAULT_PIPELINE

    d = dataclasses.replace(Config(), layers=8, hidden=512, intermediate=0, seq=256, batch=8)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="2,2", help="dp,tp sizes (one gloo rank each)")
    ap.add_argument("--steps", type=int, default=d.steps, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first (the last counts bytes)")
    ap.add_argument("--profile-steps", type=int, default=5, help="profiled steps per meshfold side")
    for size in SIZES:
        ap.add_argument(f"--{size.replace('_', '-')}", type=int, default=getattr(d, size))
    ap.add_argument("--pipeline", help="the overlap side's pipeline (default: DEFAULT_PIPELINE)")
    ap.add_argument("--plan", default="fsdp+tp", help="both meshfold sides' plan (a preset, or auto)")
    ap.add_argument(
        "--backend", default="eager", choices=("eager", "inductor"), help="how both meshfold sides' programs run"
    )
    ap.add_argument("--json", metavar="PATH", help="also write the figures measured to PATH")
    optimizer_option(ap, d)
    a = ap.parse_args(argv)
    mesh = tuple(int(s) for s in a.mesh.split(","))
    if len(mesh) != 2:
        ap.error(f"--mesh {a.mesh} must be two sizes dp,tp")
    if a.warmup < 1 or a.steps < 1 or a.profile_steps < 1:
        ap.error("--warmup, --steps and --profile-steps must be at least 1")
    sizes = {size: getattr(a, size) for size in SIZES}
    sizes["intermediate"] = sizes["intermediate"] or llama_intermediate(a.hidden)
    cfg = dataclasses.replace(d, warmup=a.warmup, steps=a.steps, optimizer=a.optimizer, **sizes)
    pipelines = {
        "overlap": a.pipeline or DEFAULT_PIPELINE,
        "no overlap": without_pass(a.pipeline or DEFAULT_PIPELINE, "overlap"),
    }
    opts = {
        "mesh": mesh,
        "plan": a.plan,
        "pipelines": pipelines,
        "profile_steps": a.profile_steps,
        "backend": a.backend,
    }
    result = spawn_ranks(_rank_main, mesh[0] * mesh[1], cfg, opts)
    ref = _single_device(cfg)
    if a.json:
        Path(a.json).write_text(json.dumps({"config": dataclasses.asdict(cfg), **opts, **result, "single": ref}))
    return _report(cfg, opts, result, ref)


if __name__ == "__main__":
    sys.exit(main())
