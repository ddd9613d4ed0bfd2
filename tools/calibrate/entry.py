"""``meshfold calibrate``: the command (docs/calibration.md).

    meshfold calibrate --ranks 4 --out cluster.json          # spawn 4 local gloo ranks
    torchrun --nproc-per-node 8 -m meshfold.tools.cli calibrate --out cluster.json
    meshfold calibrate --from-profile dumps/step-measured.json --cluster cluster.json --out refit.json

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment) the ranks are the launcher's and
the process group is initialised from that environment (or reused when it already is); rank 0
fits and writes the file. Otherwise ``--ranks`` local CPU ranks are spawned (``tools.ranks``).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshfold.target.cluster_file import ClusterFile, load_cluster, read_cluster_file, write_cluster_file
from meshfold.target.hardware import DEVICES, LOCAL, Cluster, local_cluster


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``calibrate`` subcommand's options."""
    p.add_argument("--ranks", type=int, default=4, help="local CPU ranks to spawn (ignored under torchrun)")
    p.add_argument("--quick", action="store_true", help="a small grid of probe points (seconds, for tests)")
    p.add_argument("--out", type=Path, default=Path("cluster.json"), help="the cluster file to write")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="what the ranks measure; default: cuda under torchrun where CUDA is available, else cpu",
    )
    p.add_argument(
        "--from-profile",
        type=Path,
        default=None,
        metavar="TRACE",
        help="refit the rates of --cluster from a torch.profiler Chrome trace of one step (recorded with shapes)",
    )
    p.add_argument(
        "--cluster",
        default=None,
        help="with --from-profile: the cluster file (or catalog text) to refit; default: the catalog's CPU ranks",
    )


def _rank_body(rank: int, args: dict[str, Any], report: Any) -> None:
    """One spawned rank (``tools.ranks.on_ranks``): measure; rank 0 sends the record back."""
    from meshfold.tools.calibrate.probes import measure

    record = measure(args["quick"], args["device"], stage=report.stage)
    if rank == 0:
        report.result(record)


def under_torchrun() -> bool:
    """True when a launcher set the process group's environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _measure_torchrun(quick: bool, device: str | None) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from meshfold.tools.calibrate.probes import measure

    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    owned = not dist.is_initialized()
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if owned:
        dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    try:
        where = f"cuda:{torch.cuda.current_device()}" if kind == "cuda" else "cpu"
        record = measure(quick, where)
    finally:
        if owned:
            dist.destroy_process_group()
    return record if int(os.environ["RANK"]) == 0 else None


def run(args: argparse.Namespace, console: Console) -> int:
    """Calibrate (or refit with ``--from-profile``), write ``--out``, print the tables."""
    from meshfold.tools.calibrate import fitting

    console = Console(width=max(console.width, 150))
    start, loaded = time.perf_counter(), os.getloadavg()[0]
    if args.from_profile is not None:
        return _refit(args, console)
    if under_torchrun():
        record = _measure_torchrun(args.quick, args.device)
        if record is None:
            return 0
    else:
        if args.ranks < 1:
            raise ValueError(f"--ranks {args.ranks}: need at least one rank")
        if args.device == "cuda":
            raise ValueError(
                "--device cuda runs under torchrun (one process per GPU), e.g. torchrun --nproc-per-node 8"
            )
        from meshfold.tools.ranks import Stages, on_ranks

        with Stages(console, "meshfold calibrate") as stages:
            results = on_ranks(_rank_body, args.ranks, {"quick": args.quick, "device": "cpu"}, stages)
        if 0 not in results:
            raise ValueError("the ranks ended without a measurement; rerun to see their errors")
        record = results[0]
    contents = fitting.fit(record)
    contents.measured["where"]["wall_s"] = time.perf_counter() - start
    write_cluster_file(args.out, contents)
    print_points(console, contents)
    print_figures(console, contents, _catalog(contents.cluster))
    where = contents.measured["where"]
    busy, cores = os.getloadavg()[0], os.cpu_count() or 1
    console.print(f"load average {loaded:.2f} before, {busy:.2f} after, on {cores} cores")
    if max(loaded, busy) > cores:
        console.print(
            f"[bold]warning[/]: the host was loaded beyond its {cores} cores while this ran; other work "
            "shared the cores the probes timed, so the figures are slower than these ranks alone: rerun it idle"
        )
    console.print(
        f"wrote {args.out} ({contents.cluster}, {where['world_size']} rank(s) on {where['host']}, "
        f"measured in {where['seconds']:.1f} s, {where['wall_s']:.1f} s in all); use it as "
        f"--cluster {args.out} or cluster={str(args.out)!r}"
    )
    return 0


def _catalog(cluster: Cluster) -> Cluster | None:
    if cluster.device.name == LOCAL:
        return local_cluster(cluster.world_size)
    if cluster.device.name in DEVICES:
        return load_cluster(f"{cluster.device.name}:{cluster.devices_per_node}x{cluster.nodes}")
    return None


def _refit(args: argparse.Namespace, console: Console) -> int:
    from meshfold.tools.calibrate.from_trace import refit

    console = Console(width=max(console.width, 150))
    text = args.cluster
    if text is None:
        start = ClusterFile(local_cluster(4), {}, {})
    elif Path(text).is_file() or text.endswith(".json"):
        start = read_cluster_file(text)
    else:
        start = ClusterFile(load_cluster(text), {}, {})
    contents, report = refit(start, args.from_profile)
    write_cluster_file(args.out, contents)
    t = Table(title=f"refit from {args.from_profile} (rank {report['rank']} of {report['world_size']})")
    for col in ("events", "used", "rms log(model / trace) before", "after"):
        t.add_column(col, justify="left" if col == "events" else "right")
    for kind, used in report["events"].items():
        b, a = report["residuals_before"][kind], report["residuals_after"][kind]
        t.add_row(kind, str(used), _log(b.get("rms_log")), _log(a.get("rms_log")))
    console.print(t)
    if report["events"]["collective"] and not report["link_bandwidth_refit"]:
        console.print(
            "the trace's collectives are too small to tell the link's bandwidth: only its fixed cost was refit"
        )
    if report["skipped"]:
        console.print("not used: " + ", ".join(f"{n} x {k}" for k, n in sorted(report["skipped"].items())))
    if report["events"]["collective"]:
        console.print(f"collectives priced on groups of {report['assumed_group_size']} (the trace's usual group)")
    print_figures(console, contents, start.cluster, title="figures: refit vs the cluster it started from")
    console.print(f"wrote {args.out}")
    return 0


def _log(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%" if x < 0 else f"{100 * x:.1f}%"


def _label(probe: str, p: dict[str, Any]) -> str:
    if probe == "gemm":
        return f"{p['dtype']} {p['m']}x{p['n']}x{p['k']}"
    if probe == "collective":
        return f"{p['kind']} over {p['size']} ({_size(p['bytes'])})"
    if probe == "attention":
        return f"causal {p['pass']} {p['dtype']}, seq {p['seq']}, {p['heads']} heads of {p['dim']}"
    return f"{p['op']} ({_size(p['bytes'])} moved)"


def _size(n: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def print_points(console: Console, contents: ClusterFile) -> None:
    """Every probe point: measured, fitted (the model on the written cluster), residual."""
    t = Table(title="measured vs fitted (slowest rank, median of repeats)")
    for col in ("probe", "point", "measured", "fitted", "residual"):
        t.add_column(col, justify="left" if col in ("probe", "point") else "right")
    points = contents.measured["points"]
    for probe in ("launch", "stream", "gemm", "attention", "collective", "host"):
        for p in points.get(probe, []):
            t.add_row(probe, _label(probe, p), _time(p["seconds"]), _time(p["fitted_s"]), _pct(p["residual"]))
    console.print(t)
    summary = contents.measured["residuals"]
    console.print(
        "residual rms by probe: "
        + ", ".join(f"{k} {100 * v['rms']:.1f}% (max {100 * v['max']:.1f}%)" for k, v in summary.items() if v["points"])
    )


def _time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-4 else f"{s * 1e6:.2f} us"


def _figures(cluster: Cluster) -> dict[str, tuple[float, str]]:
    dev = cluster.device
    out: dict[str, tuple[float, str]] = {f"device.peak.{n}": (v / 1e9, "GFLOP/s") for n, v in dev.peak}
    out["device.hbm_bw"] = (dev.hbm_bw / 1e9, "GB/s")
    out["device.host_bw"] = (dev.host_bw / 1e9, "GB/s")
    for name in dev.eff.__slots__:
        v = getattr(dev.eff, name)
        out[f"device.efficiency.{name}"] = (v * 1e6, "us") if name.endswith("_s") else (v, "")
    for side in ("intra", "inter"):
        link = getattr(cluster, side)
        out[f"{side}.bw"] = (link.bw / 1e9, "GB/s")
        out[f"{side}.latency_s"] = (link.latency_s * 1e6, "us")
        out[f"{side}.efficiency"] = (link.efficiency, "")
    return out


def print_figures(console: Console, contents: ClusterFile, other: Cluster | None, title: str = "") -> None:
    """The written figures beside ``other``'s (the catalog's, or the cluster a refit started from)."""
    t = Table(title=title or "figures: written vs the catalog")
    for col in ("figure", "written", "catalog" if not title else "before", "source"):
        t.add_column(col, justify="right" if col in ("written", "catalog", "before") else "left")
    ours = _figures(contents.cluster)
    theirs = _figures(other) if other is not None else {}
    for name, (value, unit) in ours.items():
        before = theirs.get(name)
        source = contents.sources.get(name) or contents.sources.get(name.split(".")[0], "")
        t.add_row(name, _num(value, unit), _num(*before) if before else "-", source)
    console.print(t)


def _num(value: float, unit: str) -> str:
    if math.isinf(value):
        return "unbounded"
    return f"{value:.4g} {unit}".strip()
