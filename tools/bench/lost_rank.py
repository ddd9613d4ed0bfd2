"""What surviving a lost rank costs: the step time asynchronous checkpoints take, and the time from a
lost node to training again on the ranks left.

    python -m meshfold.tools.bench.lost_rank                        # both parts
    python -m meshfold.tools.bench.lost_rank --part checkpoint --rounds 5 --every 10
    python -m meshfold.tools.bench.lost_rank --part recovery

``checkpoint``: 4 gloo ranks train a Llama-shaped model (vocab 4096, hidden 256, 2 layers: 4.3 M
parameters, 52 MB of weights and AdamW state) under fsdp on dp=4. Each round runs ``2 x every``
steps three ways, interleaved round by round so that drift in load hits them alike: no checkpoint;
``pm.checkpoint`` (asynchronous: the step waits only while the state is copied to host memory) every
``every`` steps; ``dcp.save`` (synchronous) every ``every`` steps. The checkpoints fall mid-segment,
``every / 2`` steps after its start and then every ``every``, so an asynchronous write has the
steps after it to overlap, as it does in a run. Printed: rank 0's median step time per way over the
rounds, each way's ratio to no checkpoint, the time a checkpoint holds the
step up (the call itself; the async write goes on beside the steps after it), and the load average.

``recovery``: 4 local torchrun agents (``meshfold.tools.local_agents``) train llama-tiny under
``meshfold.train`` (``plan="auto"``, a checkpoint every 3 steps); one node is killed (SIGKILL) after
a step, then one of the 3 left hangs (SIGSTOP). Printed per loss: seconds to detect it, to restart
the ranks left, to re-plan and reload there, from the loss to the first step after, and the steps
lost. Every figure is measured in this run; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshfold.tools.bench.eager_vs_dtensor import gloo_rank
from meshfold.tools.ranks import free_port

WAYS = ("none", "async", "sync")


def _build() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from meshfold.tools.zoo.models import LlamaTiny

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = LlamaTiny(vocab=4096, hidden=256, intermediate=1024)
    ids = torch.randint(0, 4096, (16, 64), generator=torch.Generator().manual_seed(0))
    return net, (ids, ids.clone())


def _segment(pm: Any, opt: Any, inputs: Any, way: str, every: int, root: str, first_step: int) -> tuple[float, float]:
    """Seconds per step over ``2 x every`` steps, checkpointing ``way`` every ``every`` steps, and the
    seconds each checkpoint held the step up (the call's own time)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist.barrier()
    start = time.perf_counter()
    held = 0.0
    for i in range(2 * every):
        opt.zero_grad()
        pm(*inputs).backward()
        opt.step()
        step = first_step + i + 1
        # NOTE: mid-interval, so each write has the steady state's ``every`` steps to overlap before
        # the segment ends (the one at the segment's end would have none)
        if (step + every // 2) % every or way == "none":
            continue
        called = time.perf_counter()
        if way == "async":
            pm.checkpoint(f"{root}/async", step, optimizer=opt)
        else:
            model_sd, optim_sd = get_state_dict(pm, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/sync/step-{step:08d}")
        held += time.perf_counter() - called
    pm.wait_checkpoint()  # NOTE: a write still in flight counts against the async way
    dist.barrier()
    return (time.perf_counter() - start) / (2 * every), held / 2


def _rank_main(rank: int, world: int, port: int, opts: dict[str, Any], queue: Any) -> None:
    with gloo_rank(rank, world, port):
        from torch.distributed.device_mesh import init_device_mesh

        from meshfold.api import parallelize

        net, inputs = _build()
        pm = parallelize(net, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), inputs, plan="fsdp")
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        roots: list[Any] = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(roots)
        every, step = opts["every"], 0
        _segment(pm, opt, inputs, "async", every, roots[0], step)  # NOTE: warm-up, the checkpoint group too
        step += 2 * every
        per_way: dict[str, list[float]] = {w: [] for w in WAYS}
        held: dict[str, list[float]] = {w: [] for w in WAYS}
        loads: list[float] = []
        for r in range(opts["rounds"]):
            order = WAYS[r % 3 :] + WAYS[: r % 3]
            for way in order:
                step_s, held_s = _segment(pm, opt, inputs, way, every, roots[0], step)
                per_way[way].append(step_s)
                held[way].append(held_s)
                step += 2 * every
            loads.append(os.getloadavg()[0])
        if rank == 0:
            queue.put({"per_way": per_way, "held": held, "loads": loads})
            import shutil

            shutil.rmtree(roots[0], ignore_errors=True)


def checkpoint_cost(rounds: int, every: int, world: int = 4) -> dict[str, Any]:
    """Rank 0's seconds per step under each way, per round, on ``world`` spawned gloo ranks."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    args = (world, free_port(), {"rounds": rounds, "every": every}, queue)
    mp.start_processes(_rank_main, args=args, nprocs=world, join=True, start_method="spawn")
    return queue.get()


def _print_checkpoint(result: dict[str, Any], every: int) -> None:
    per_way = result["per_way"]
    base = statistics.median(per_way["none"])
    print(f"checkpoint every {every} steps, 4 gloo ranks, fsdp on dp=4, {os.cpu_count()} cores")
    print(f"{'way':<8} {'step ms':>9} {'ratio':>7} {'held ms':>8}  per-round ratio (load)")
    for way in WAYS:
        med = statistics.median(per_way[way])
        held = 1e3 * statistics.median(result["held"][way])
        rounds = " ".join(
            f"{t / b:.3f}({load:.1f})"
            for t, b, load in zip(per_way[way], per_way["none"], result["loads"], strict=True)
        )
        print(f"{way:<8} {1e3 * med:>9.1f} {med / base:>7.3f} {held:>8.1f}  {rounds}")


def _print_recovery(rows: list[dict[str, float]], outcome: Any) -> None:
    load = os.getloadavg()[0]
    print(f"\nrecovery: 4 local torchrun agents, llama-tiny, plan='auto', a checkpoint every 3 steps (load {load:.2f})")
    print(f"{'loss':<20} {'detect':>7} {'restart':>8} {'plan':>6} {'reload':>7} {'to step':>8} {'lost':>5}")
    for how, r in zip(("kill", "stop"), rows, strict=False):
        label = f"{how} (world {int(r['world'])}->{int(r['world']) - 1})"
        print(
            f"{label:<20} {r['detect_s']:>6.1f}s {r['restart_s']:>7.1f}s {r['plan_s']:>5.1f}s {r['reload_s']:>6.2f}s "
            f"{r['to_first_step_s']:>7.1f}s {int(r['steps_lost']):>5}"
        )
    print("exit codes of the nodes left:", outcome.codes)


def main(argv: Sequence[str] | None = None) -> int:
    doc = (__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m meshfold.tools.bench.lost_rank", description=doc)
    parser.add_argument("--part", choices=("checkpoint", "recovery", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    args = parser.parse_args(argv)
    if args.part in ("checkpoint", "both"):
        _print_checkpoint(checkpoint_cost(args.rounds, args.every), args.every)
    if args.part in ("recovery", "both"):
        from meshfold.tools.local_agents import Loss, lose_nodes, recoveries

        with tempfile.TemporaryDirectory() as work:
            outcome = lose_nodes(work, [Loss("kill", 4, 4, 2), Loss("stop", 3, 9, 1)])
            _print_recovery(recoveries(outcome), outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main())
