"""gloo's own all-gather and reduce-scatter against the all-to-alls meshfold sends them as on gloo.

    python -m meshfold.tools.bench.gloo_collectives                 # 4 gloo CPU ranks, groups of 2
    python -m meshfold.tools.bench.gloo_collectives --world 4 --group 4 --mib 1 4 16

Spawns ``--world`` local CPU ranks (gloo, one thread each) split into groups of ``--group`` ranks
(as the axes of a (dp, tp) mesh are), and on every group at once, for each operand size, runs each
way of a collective ``--calls`` times in a row, ``--rounds`` rounds, the ways interleaved round by
round so that drift in machine load hits them alike:

- reduce-scatter (sum) of an operand of ``MiB`` per rank: ``reduce_scatter_tensor``, against
  ``backends.collectives.scatter_by_all_to_all`` (each rank's blocks sent to their ranks) and the sum of
  what arrives;
- all-gather of ``MiB / group`` per rank: ``all_gather_into_tensor``, against the operand repeated
  once per rank and sent by ``backends.collectives.gather_by_all_to_all``.

Measured: wall time per call (rank 0, the median round) and the CPU time per call of every rank's
process (all threads: gloo's workers too), summed over the ranks. Both ways' results are compared
(exit 1 if they differ beyond fp32 rounding: a group of more than 2 may sum in another order).
Timings are printed, never asserted, each with the load average beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshfold.tools.bench.eager_vs_dtensor import Config, gloo_rank, spawn_ranks

c10d = torch.ops._c10d_functional


def _ways(x: torch.Tensor, n: int, group: str) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    """For each collective, its ways: gloo's own call and the all-to-all meshfold sends, each
    returning its result once written."""
    from meshfold.backends.collectives import gather_by_all_to_all, scatter_by_all_to_all

    rows, part = x.shape[0] // n, x[: x.shape[0] // n].contiguous()

    def scatter_own() -> torch.Tensor:
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", n, group))

    def scatter_by_all_to_all_() -> torch.Tensor:
        arrived = c10d.wait_tensor(scatter_by_all_to_all(x, rows, n, group))
        return arrived.view(n, rows).sum(0)

    def gather_own() -> torch.Tensor:
        return c10d.wait_tensor(c10d.all_gather_into_tensor(part, n, group))

    def gather_by_all_to_all_() -> torch.Tensor:
        return c10d.wait_tensor(gather_by_all_to_all(part.repeat(n), rows, n, group))

    return {
        "reduce-scatter": {"gloo": scatter_own, "all-to-all": scatter_by_all_to_all_},
        "all-gather": {"gloo": gather_own, "all-to-all": gather_by_all_to_all_},
    }


def _rank_main(rank: int, world: int, port: int, cfg_dict: dict[str, Any], opts: dict[str, Any], queue: Any) -> None:
    del cfg_dict
    with gloo_rank(rank, world, port):
        size = opts["group"]
        groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
        group = groups[rank // size].group_name
        out: dict[str, Any] = {}
        for mib in opts["mib"]:
            x = torch.randn(int(mib * 2**20) // 4 // size * size, generator=torch.Generator().manual_seed(rank))
            ways = _ways(x, size, group)
            for kind, by_way in ways.items():
                walls: dict[str, list[float]] = {w: [] for w in by_way}
                cpus: dict[str, list[float]] = {w: [] for w in by_way}
                for _ in range(opts["rounds"]):
                    for way, call in by_way.items():
                        dist.barrier()
                        t0, c0 = time.perf_counter(), time.process_time()
                        for _ in range(opts["calls"]):
                            call()
                        walls[way].append((time.perf_counter() - t0) / opts["calls"])
                        cpus[way].append((time.process_time() - c0) / opts["calls"])
                results = [call() for call in by_way.values()]
                same = all(torch.allclose(results[0], r, rtol=1e-6, atol=1e-5) for r in results[1:])
                cpu = {w: statistics.median(c) for w, c in cpus.items()}
                everyone: list[Any] = [None] * world
                dist.all_gather_object(everyone, (cpu, same))
                out[f"{kind} {mib:g}"] = {
                    "wall": {w: statistics.median(t) for w, t in walls.items()},
                    "cpu": {w: sum(c[0][w] for c in everyone) for w in by_way},
                    "same": all(c[1] for c in everyone),
                    "load": os.getloadavg()[0],
                }
        if rank == 0:
            queue.put(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4, help="gloo ranks (one thread each)")
    ap.add_argument("--group", type=int, default=2, help="ranks per group (the world is cut into groups)")
    ap.add_argument("--mib", type=float, nargs="+", default=[1.0, 4.0, 16.0], help="reduce-scatter operand sizes")
    ap.add_argument("--calls", type=int, default=10, help="calls per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per way, interleaved")
    a = ap.parse_args(argv)
    if a.group < 2 or a.world % a.group:
        ap.error("--group must be at least 2 and divide --world")
    opts = {"group": a.group, "mib": a.mib, "calls": a.calls, "rounds": a.rounds}
    r = spawn_ranks(_rank_main, a.world, Config(), opts)
    print(f"{a.world} gloo CPU ranks on {len(os.sched_getaffinity(0))} cores, groups of {a.group}, every group at once")
    print(f"{'collective, operand MiB':<24}  {'way':<10}  {'ms/call':>8}  {'CPU ms/call':>11}  {'load':>5}")
    bad = False
    for name, m in r.items():
        for way in m["wall"]:
            row = f"{name:<24}  {way:<10}  {m['wall'][way] * 1e3:>8.2f}  {m['cpu'][way] * 1e3:>11.2f}"
            print(f"{row}  {m['load']:>5.2f}")
        own, a2a = m["wall"]["gloo"], m["wall"]["all-to-all"]
        cpu_own, cpu_a2a = m["cpu"]["gloo"], m["cpu"]["all-to-all"]
        print(f"{'':<24}  gloo / all-to-all: {own / a2a:.2f}x time, {cpu_own / cpu_a2a:.2f}x CPU")
        if not m["same"]:
            print(f"!!! {name}: the two ways' results differ !!!")
            bad = True
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
