"""MoE parallel folding (Megatron-Core): folded vs unfolded expert mappings, simulated.

    python -m meshfold.tools.bench.sim.moe_folding

Attention layers run on ``tp x cp x dp x pp`` and expert layers on ``etp x ep x edp x pp`` of the
same ranks. *Unfolded* is the classic layout: experts reuse the attention tensor-parallel group
(``etp == tp``) and expert parallelism nests inside data parallelism, so with ``tp > 1`` an
expert-parallel group strides over nodes. *Folded* lets ``etp`` differ from ``tp`` and ``ep`` take
the innermost ranks, which attention uses for ``tp`` (and ``cp`` / ``dp``), keeping the all-to-all
on NVLink as long as ``etp x ep`` fits a node.

For a Mixtral-8x22B and a DeepSeek-V3 shaped model on H100 clusters (sequence 4,096 as in the
published Megatron-Core runs of REFERENCES.md; cluster sizes of the order of the MoE folding
runs, which reach 1,024 H100s), every figure below is computed here, in this run:

1. the best unfolded plan (search pinned to ``moe_mapping=unfolded``);
2. its folded twin: the same attention mesh and ``ep`` with ``etp = 1`` -- folding alone;
3. the best folded plan (search pinned to ``moe_mapping=folded``);
4. the best plan of the unpinned search.

Each row shows step time, MFU, the all-to-all bytes one device sends per step, the time the step
waits on them, peak memory per device and whether it fits, and the ratio folded / unfolded. The
published MFU is printed where REFERENCES.md lists one for the model (it lists none for MoE
models yet: the column then shows "-").

Caveats: DeepSeek-V3's 61 layers allow no pipeline split here (the simulator needs layers
divisible by pp x vpp), and the multi-token-prediction module is not modelled.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace

from rich.console import Console
from rich.table import Table

from meshfold.sim import ParallelConfig, TrainSpec, parse_cluster, preset, search_configs, simulate
from meshfold.sim.model import ModelSpec
from meshfold.sim.result import SimResult
from meshfold.sim.simulate import layer_plan
from meshfold.target.hardware import Cluster

GIB = 2**30


@dataclass(frozen=True, slots=True)
class Case:
    """One model on one cluster; ``published_mfu`` as REFERENCES.md lists it (None: not listed)."""

    label: str
    model: ModelSpec
    cluster: str
    seq: int
    global_batch: int
    published_mfu: float | None = None


CASES = (
    Case("Mixtral-8x22B", preset("mixtral-8x22b"), "h100:8x16", 4096, 256),
    Case("DeepSeek-V3", preset("deepseek-v3"), "h100:8x128", 4096, 1024),
)


@dataclass(frozen=True, slots=True)
class Row:
    """One simulated plan of a case."""

    what: str
    config: ParallelConfig
    result: SimResult


def ep_placement(cluster: Cluster, cfg: ParallelConfig) -> str:
    """Where the expert-parallel group sits, e.g. ``8 = 8/node x 1``."""
    g = layer_plan(cluster, cfg).ep_group
    return f"{g.size} = {g.per_node}/node x {g.nodes}"


def best(model: ModelSpec, cluster: Cluster, train: TrainSpec, mapping: str | None) -> SimResult | None:
    """The fastest plan that fits, with the expert mapping pinned when ``mapping`` is given."""
    fixed = {"moe_mapping": mapping} if mapping else None
    found = search_configs(model, cluster, train, fixed=fixed, top=1)
    return found[0].result if found else None


def rows_for(case: Case) -> tuple[list[Row], float]:
    """The four plans of the module docstring for ``case`` and the seconds the searches took."""
    cluster = parse_cluster(case.cluster)
    train = TrainSpec(seq_len=case.seq, global_batch=case.global_batch)
    start = time.perf_counter()
    unfolded = best(case.model, cluster, train, "unfolded")
    folded = best(case.model, cluster, train, "folded")
    overall = best(case.model, cluster, train, None)
    took = time.perf_counter() - start
    rows: list[Row] = []
    if unfolded is not None:
        rows.append(Row("unfolded: best", unfolded.config, unfolded))
        twin = replace(unfolded.config, etp=1, moe_mapping="folded")
        rows.append(Row("folded: same attention mesh, etp 1", twin, simulate(case.model, cluster, twin, train)))
    if folded is not None:
        rows.append(Row("folded: best", folded.config, folded))
    if overall is not None:
        rows.append(Row("search: best of any mapping", overall.config, overall))
    return rows, took


def case_table(case: Case, rows: list[Row]) -> Table:
    """Side-by-side plans of one case, each step time also as a ratio to the best unfolded one."""
    cluster = parse_cluster(case.cluster)
    title = (
        f"{case.label} ({case.model.param_count() / 1e9:.0f} B params, {case.model.num_experts} experts, "
        f"top-{case.model.top_k}) on {cluster}, seq {case.seq}, global batch {case.global_batch}"
    )
    t = Table(title=title)
    cols = ("plan kind", "plan", "EP group", "step (s)", "MFU", "a2a/dev (GiB)", "a2a wait (s)", "peak (GiB)", "fits")
    for col in (*cols, "step / unfolded"):
        t.add_column(col, justify="left" if col in ("plan kind", "plan", "EP group") else "right")
    base = rows[0].result.step_time_s if rows and rows[0].what.startswith("unfolded") else None
    for r in rows:
        res = r.result
        t.add_row(
            r.what,
            r.config.describe(),
            ep_placement(cluster, r.config),
            f"{res.step_time_s:.3f}",
            f"{res.mfu:.1%}",
            f"{res.a2a_bytes / GIB:.1f}",
            f"{res.a2a_exposed_s:.3f}",
            f"{res.peak_memory_bytes / GIB:.1f}",
            "yes" if res.fits else "NO",
            f"{res.step_time_s / base:.3f}" if base else "-",
        )
    return t


def summary_row(case: Case, rows: list[Row], took: float) -> list[str]:
    """Best plan, our MFU beside the published one, and the folded / unfolded ratios."""
    by = {r.what: r.result for r in rows}
    unf, twin = by.get("unfolded: best"), by.get("folded: same attention mesh, etp 1")
    fold, top = by.get("folded: best"), by.get("search: best of any mapping")

    def ratio(a: SimResult | None, b: SimResult | None) -> str:
        return f"{a.step_time_s / b.step_time_s:.3f}" if a and b else "-"

    pub = f"{case.published_mfu:.1%}" if case.published_mfu is not None else "-"
    return [
        case.label,
        str(parse_cluster(case.cluster).world_size),
        top.config.describe() if top else "nothing fits",
        f"{top.mfu:.1%}" if top else "-",
        pub,
        ratio(twin, unf),
        ratio(fold, unf),
        f"{took:.1f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=220)
    start = time.perf_counter()
    summary = Table(title="MoE parallel folding: summary (step-time ratios folded / unfolded, same run)")
    for col in (
        "model",
        "GPUs",
        "best plan found",
        "our MFU",
        "published MFU",
        "same mesh",
        "best vs best",
        "search s",
    ):
        summary.add_column(col, justify="left" if col in ("model", "best plan found") else "right")
    for case in CASES:
        rows, took = rows_for(case)
        console.print(case_table(case, rows))
        summary.add_row(*summary_row(case, rows, took))
    console.print(summary)
    console.print(f"total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
