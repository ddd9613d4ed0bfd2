"""Pipeline placement on a cluster of node groups with different NICs (the SkipPipe / Holmes idea).

    python -m meshfold.tools.bench.sim.heterogeneous_network

A cluster of 8 nodes with InfiniBand NDR (400 Gb/s per GPU) and 8 with RoCE (200 Gb/s per GPU),
``h100:8x8@ib+h100:8x8@roce``. The heterogeneity-aware placement (``parse_cluster``'s: pp outermost,
ranks filling the IB group first) keeps every dp and tp group inside one node group, puts the one
stage boundary that crosses groups on the slower NIC and stage 0 -- whose gradient reduction has
no later stage to hide behind -- on IB. The placement that ignores the NICs hands nodes out in
turn (IB, RoCE, IB, ...), so every dp group spans both kinds and runs at RoCE speed. Both are
simulated with the same plan; the table prints both step times and their ratio, beside the same
plan on 16 IB nodes and on 16 RoCE nodes.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from meshfold.sim import Cluster, NodeGroup, ParallelConfig, TrainSpec, parse_cluster, preset, simulate

MIXED = "h100:8x8@ib+h100:8x8@roce"
PLANS = (
    ("llama3-70b", ParallelConfig(dp=16, tp=4, pp=2), TrainSpec(8192, 256)),
    ("llama3-70b", ParallelConfig(dp=8, tp=8, pp=2), TrainSpec(8192, 128)),
    ("llama3-70b", ParallelConfig(dp=4, tp=8, pp=4), TrainSpec(8192, 64)),
    ("llama3-8b", ParallelConfig(dp=32, tp=2, pp=2), TrainSpec(8192, 256)),
)


def interleaved(cluster: Cluster) -> Cluster:
    """``cluster`` with its nodes handed out one group after the other in turn (IB, RoCE, IB, ...):
    a placement that ignores which NIC a node has."""
    per = [g.nodes for g in cluster.groups]
    order: list[NodeGroup] = []
    for i in range(max(per)):
        order += [replace(g, nodes=1) for g, n in zip(cluster.groups, per, strict=True) if i < n]
    return replace(cluster, groups=tuple(order))


def main() -> int:
    console = Console() if Console().is_terminal else Console(width=170)
    mixed = parse_cluster(MIXED)
    naive = interleaved(mixed)
    ib, roce = parse_cluster("h100:8x16@ib"), parse_cluster("h100:8x16@roce")
    t = Table(title=f"{MIXED}: heterogeneity-aware placement vs nodes handed out in turn (step seconds)")
    for col in ("model", "plan", "aware", "NIC-blind", "blind / aware", "all IB", "all RoCE", "aware dp exposed"):
        t.add_column(col, justify="left" if col in ("model", "plan") else "right")
    for name, cfg, train in PLANS:
        model = preset(name)
        aware, blind = (simulate(model, c, cfg, train, timeline=False) for c in (mixed, naive))
        all_ib, all_roce = (simulate(model, c, cfg, train, timeline=False) for c in (ib, roce))
        t.add_row(
            name,
            cfg.describe(),
            f"{aware.step_time_s:.3f}",
            f"{blind.step_time_s:.3f}",
            f"{blind.step_time_s / aware.step_time_s:.3f}x",
            f"{all_ib.step_time_s:.3f}",
            f"{all_roce.step_time_s:.3f}",
            f"{dict(aware.breakdown)['dp exposed']:.3f}",
        )
    console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
