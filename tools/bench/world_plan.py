"""The mesh chosen from a world size against every mesh measured: predicted and measured steps.

    python -m meshfold.tools.bench.world_plan                         # 4 gloo CPU ranks, the catalog cpu part
    python -m meshfold.tools.bench.world_plan --cluster cluster.json  # figures `meshfold calibrate` measured
    python -m meshfold.tools.bench.world_plan --models dense --steps 5
    python -m meshfold.tools.bench.world_plan --cluster cluster.json --refit  # refit from a profiled step first

For each model (``dense``: the zoo's llama-tiny on a batch of 8 sequences of 64 tokens; ``moe``: the
zoo's mixtral-tiny on 8 x 32; ``long``: the zoo's transformers Llama on one sequence of 1,024), rank 0 prices every
(mesh, plan) candidate of the world exactly as ``parallelize(model, world, inputs, plan="auto")``
does (``meshfold.world.choose``), then every rank compiles and trains each candidate that runs:
one step of each in turn, ``--steps`` rounds after one of warm-up, so that drift in the host's load
falls on all alike; a step's forward and backward (the program the compile made and the time model
prices) and its AdamW step are timed apart, each from a barrier, the slowest rank's time, medians
over the rounds. It prints, per model, the predicted and measured forward + backward of every
candidate beside its optimizer step, the measured step of the one chosen against the fastest measured, Spearman's
rank correlation between predicted and measured, and the mean relative error of the predictions,
with the load average beside each figure (the host is shared: repeat before believing a ratio).

The goals it checks (printed, never asserted), on the forward + backward: the chosen candidate's
measured step within 10% of the fastest measured; Spearman >= 0.8 between predicted and measured;
predicted within 25% of measured on average.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from meshfold.tools.ranks import Reporter, Stages, on_ranks

MODELS: dict[str, tuple[str, tuple[int, int]]] = {
    "dense": ("llama-tiny", (8, 64)),
    "moe": ("mixtral-tiny", (8, 32)),
    "long": ("hf-llama", (1, 1024)),
}
"""Bench model → (zoo model, (batch, sequence) of its token inputs)."""
GOALS = {"chosen_vs_fastest": 1.10, "spearman": 0.8, "relative_error": 0.25}


def _inputs(tokens: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, tokens, generator=torch.Generator().manual_seed(0))
    return ids, ids.clone()


def _model(name: str) -> torch.nn.Module:
    from meshfold.tools.zoo import build

    torch.manual_seed(0)
    return build(name)[0]


def _choice(name: str, tokens: tuple[int, int], world: int, cluster: str | None) -> dict[str, Any]:
    """Rank 0's pricing of every candidate (``world.choose``), as plain data."""
    from meshfold.world import choose

    start = time.perf_counter()
    choice, _ = choose(_model(name), _inputs(tokens), world, {"cluster": cluster})
    return {
        "seconds": time.perf_counter() - start,
        "chosen": choice.chosen.label,
        "head": choice.lines()[0],
        "candidates": [(c.mesh.names, c.mesh.sizes, c.plan, c.label, c.step_s, c.refused) for c in choice.candidates],
    }


def _compiled(name: str, tokens: tuple[int, int], names: Any, sizes: Any, plan: str, cluster: str | None) -> Any:
    """One candidate compiled on these ranks, with its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshfold import parallelize

    mesh = init_device_mesh("cpu", tuple(sizes), mesh_dim_names=tuple(names))
    pm = parallelize(_model(name), mesh, _inputs(tokens), plan=plan, cluster=cluster)
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3)


def _slowest(seconds: float) -> float:
    took = torch.tensor([seconds])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _step(pm: Any, opt: Any, inputs: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    """(forward + backward, optimizer) seconds of one step, the slowest rank's, barriers around each."""
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    pm(*inputs).backward()
    program = _slowest(time.perf_counter() - start)
    start = time.perf_counter()
    opt.step()
    return program, _slowest(time.perf_counter() - start)


def _priced(rank: int, name: str, tokens: tuple[int, int], world: int, cluster: str | None) -> dict[str, Any]:
    """Rank 0's ``_choice``, broadcast to every rank (an error as ``{"error": ...}``)."""
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload[0] = _choice(name, tokens, world, cluster)
        except Exception as e:  # NOTE: reported with the others' figures, not lost with them
            payload[0] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _refit(rank: int, key: str, choice: dict[str, Any], tokens: tuple[int, int], args: dict[str, Any]) -> str:
    """Train the chosen candidate, profile one step of rank 0 and refit the cluster from it
    (``meshfold calibrate --from-profile``): the path of the refit cluster file, on every rank."""
    from torch.profiler import ProfilerActivity, profile

    from meshfold.target.cluster_file import ClusterFile, read_cluster_file, write_cluster_file
    from meshfold.target.hardware import local_cluster
    from meshfold.tools.calibrate.from_trace import refit

    names, sizes, plan, *_ = next(c for c in choice["candidates"] if c[3] == choice["chosen"])
    pm, opt = _compiled(MODELS[key][0], tokens, names, sizes, plan, args["cluster"])
    inputs = _inputs(tokens)
    for _ in range(2):
        _step(pm, opt, inputs)
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    # NOTE: every rank runs the step (its collectives need them all); rank 0's trace is the one read
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=False) as prof:
        pm(*inputs).backward()
    out: list[Any] = [None]
    if rank == 0:
        trace = os.path.join(args["scratch"], f"{key}-step.json")
        prof.export_chrome_trace(trace)
        start = (
            ClusterFile(local_cluster(args["world"]), {}, {})
            if args["cluster"] is None
            else read_cluster_file(args["cluster"])
        )
        contents, _ = refit(start, trace)
        out[0] = os.path.join(args["scratch"], f"{key}-refit.json")
        write_cluster_file(out[0], contents)
    dist.broadcast_object_list(out, src=0)
    return str(out[0])


def _body(rank: int, args: dict[str, Any], report: Reporter) -> None:
    out = {}
    for key in args["models"]:
        name, tokens = MODELS[key]
        report.stage(f"{key}: pricing every mesh of {args['world']} ranks for {name} {tokens}")
        choice = _priced(rank, name, tokens, args["world"], args["cluster"])
        if "error" in choice:
            out[key] = choice
            continue
        cluster, before = args["cluster"], None
        if args["refit"]:
            report.stage(f"{key}: profiling a step of {choice['chosen']} and refitting the cluster from it")
            cluster = _refit(rank, key, choice, tokens, args)
            before = choice
            choice = _priced(rank, name, tokens, args["world"], cluster)
            if "error" in choice:
                out[key] = choice
                continue
        runs = [c for c in choice["candidates"] if not c[5]]
        report.stage(f"{key}: compiling the {len(runs)} candidates that run")
        modules = [_compiled(name, tokens, names, sizes, plan, cluster) for names, sizes, plan, *_ in runs]
        inputs = _inputs(tokens)
        times: list[list[tuple[float, float]]] = [[] for _ in runs]
        loads = []
        # NOTE: one step of each candidate in turn, then the next round, so drift in the host's load
        # falls on all alike; the first round warms up
        for r in range(args["steps"] + 1):
            report.stage(f"{key}: round {r} of {args['steps']} over {len(runs)} candidates")
            for i, (pm, opt) in enumerate(modules):
                got = _step(pm, opt, inputs)
                if r:
                    times[i].append(got)
            loads.append(os.getloadavg()[0])
        measured = {
            c[3]: tuple(statistics.median(t[k] for t in ts) for k in (0, 1)) for c, ts in zip(runs, times, strict=True)
        }
        rows = [(c[3], c[4], *measured.get(c[3], (None, None)), c[5]) for c in choice["candidates"]]
        out[key] = {**choice, "rows": rows, "load": (min(loads), max(loads)), "before": before}
        del modules
    report.result(out)


def _spearman(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic) if len(xs) > 2 else float("nan")


def show(console: Console, key: str, result: dict[str, Any]) -> dict[str, float]:
    """Print one model's table and figures; return the figures the goals read."""
    name, tokens = MODELS[key]
    table = Table(title=f"{key}: {name}, batch x seq {tokens[0]} x {tokens[1]} (forward + backward)")
    for col in ("candidate", "predicted ms", "measured ms", "predicted / measured", "optimizer ms", "note"):
        table.add_column(col, justify="left" if col in ("candidate", "note") else "right")
    runs = [(label, p, m) for label, p, m, _, _ in result["rows"] if m is not None]
    fastest = min(m for _, _, m in runs)
    for label, p, m, opt, refused in result["rows"]:
        note = refused or ("chosen" if label == result["chosen"] else "") + (" fastest" if m == fastest else "")
        cells = ("-",) * 4 if m is None else (f"{1e3 * p:.2f}", f"{1e3 * m:.2f}", f"{p / m:.2f}", f"{1e3 * opt:.2f}")
        table.add_row(label, *cells, note.strip())
    console.print(table)
    figures = _figures(runs, result["chosen"])
    low, high = result["load"]
    console.print(
        f"{result['head']}\n"
        f"priced {len(result['rows'])} candidates in {result['seconds']:.1f} s; chosen {result['chosen']} "
        f"measures {figures['chosen_vs_fastest']:.2f}x the fastest measured (goal <= {GOALS['chosen_vs_fastest']}); "
        f"Spearman {figures['spearman']:.2f} over {len(runs)} (goal >= {GOALS['spearman']}); "
        f"predicted vs measured: mean |error| {figures['relative_error']:.0%}, worst "
        f"{figures['worst_relative_error']:.0%} (goal <= {GOALS['relative_error']:.0%}); load {low:.2f}-{high:.2f}"
    )
    before = result.get("before")
    if before is not None:
        # NOTE: the same measured steps against the predictions made before the refit
        priced = {c[3]: c[4] for c in before["candidates"] if not c[5]}
        pairs = [(label, priced[label], m) for label, _, m in runs if label in priced]
        if pairs and before["chosen"] in priced:
            b = _figures(pairs, before["chosen"])
            console.print(
                f"before the refit from a profiled step of {before['chosen']}: chosen {before['chosen']} "
                f"{b['chosen_vs_fastest']:.2f}x the fastest measured; Spearman {b['spearman']:.2f}; "
                f"mean |error| {b['relative_error']:.0%}, worst {b['worst_relative_error']:.0%}"
            )
    return figures


def _figures(runs: list[tuple[str, float, float]], chosen: str) -> dict[str, float]:
    """The goals' figures of (label, predicted, measured) rows: how the chosen one measures against
    the fastest, Spearman's correlation, the mean and worst relative error."""
    fastest = min(m for _, _, m in runs)
    picked = next((m for label, _, m in runs if label == chosen), math.nan)
    return {
        "chosen_vs_fastest": picked / fastest,
        "spearman": _spearman([p for _, p, _ in runs], [m for _, _, m in runs]),
        "relative_error": statistics.mean(abs(p / m - 1) for _, p, m in runs),
        "worst_relative_error": max(abs(p / m - 1) for _, p, m in runs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=4, help="local CPU ranks")
    ap.add_argument("--models", default="dense,moe,long", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument(
        "--cluster", default=None, help="cluster the plans are priced for (a cluster file); default: catalog cpu"
    )
    ap.add_argument(
        "--refit",
        action="store_true",
        help="profile a step of the first choice, refit the cluster from it (calibrate --from-profile), choose again",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps per candidate (after one warm-up)")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    console = Console()
    with Stages(console, "world_plan") as stages, tempfile.TemporaryDirectory(prefix="world_plan.") as scratch:
        results = on_ranks(
            _body,
            args.world,
            {
                "models": models,
                "world": args.world,
                "cluster": args.cluster,
                "steps": args.steps,
                "refit": args.refit,
                "scratch": scratch,
            },
            stages,
        )
    met = True
    for key, result in results[0].items():
        if "error" in result:
            console.print(f"{key}: {result['error']}")
            met = False
            continue
        figures = show(console, key, result)
        met &= all(figures[k] <= GOALS[k] if k != "spearman" else figures[k] >= GOALS[k] for k in GOALS)
    console.print(f"goals {'met' if met else 'NOT met'} on every model (cluster: {args.cluster or 'catalog cpu'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
