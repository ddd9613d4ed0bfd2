"""``meshfold plan``: rank parallel plans for a model on a cluster with the simulator.

    meshfold plan --model config.json --cluster h100:8x64 --seq 4096 --global-batch 1024 --dtype bf16

``--model`` takes an HF config JSON file, a zoo name, a published architecture (``llama3-8b``), or
``module:factory`` (imported from the current directory; returning ``(model, example_inputs)``
as for ``pass-debug``, or a ModelSpec or an HF config). Models without an HF config are read off
their modules (``meshfold.tools.plan_spec``). ``--fixed "tp=8,pp=4,dp=16"`` evaluates that one
configuration; ``--mesh dp=8,tp=8`` pins the mesh and searches the rest (micro-batch, recompute,
ZeRO stage, overlap; for MoE models also ep, etp and the folded / unfolded expert mapping, e.g.
``--fixed "tp=2,dp=32,ep=8,etp=1"`` or ``--fixed "tp=2,dp=32,ep=8,moe_mapping=unfolded"``).
``--routing-imbalance`` sets the busiest expert rank's load over the mean (default: the model's,
1.0 for presets). ``--cluster`` may join node groups with different NICs, e.g.
``h100:8x4@ib+h100:8x4@roce`` (``meshfold.target.hardware.parse_cluster``), or name a cluster file
that ``meshfold calibrate`` wrote (``meshfold.target.cluster_file.load_cluster``). For plans with a pipeline
the table is followed by each plan's schedule and layers per stage.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshfold.sim import (
    Cluster,
    ModelSpec,
    ParallelConfig,
    Ranked,
    TrainSpec,
    from_hf_config,
    plot_memory,
    search_configs,
    simulate,
    to_chrome_trace,
)
from meshfold.sim.model import PRESETS
from meshfold.sim.parallel import ConfigError
from meshfold.sim.result import SimResult
from meshfold.target.cluster_file import load_cluster

GIB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's options."""
    p.add_argument("--model", required=True, help="HF config .json, zoo name, llama3-8b..., or module:factory")
    p.add_argument(
        "--cluster",
        required=True,
        help="DEVICE:GPUS_PER_NODExNODES[@NIC], e.g. h100:8x64; node groups with different NICs joined by +, e.g. "
        "h100:8x4@ib+h100:8x4@roce (ib = InfiniBand NDR 400, roce = RoCE 200 GbE, or a link name); or a cluster "
        "file written by `meshfold calibrate` (a path ending in .json)",
    )
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=1024, help="sequences per optimizer step")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--fixed", default=None, help='evaluate one configuration, e.g. "tp=8,pp=16,dp=64"')
    p.add_argument("--mesh", default=None, help="pin the mesh, e.g. dp=8,tp=8, and search the rest")
    p.add_argument(
        "--routing-imbalance",
        type=float,
        default=None,
        metavar="FLOAT",
        help="MoE: busiest expert rank's tokens over the mean (>= 1.0)",
    )
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print the best plan as one JSON object")
    p.add_argument("--trace", type=Path, default=None, help="write the best plan's simulated step (Chrome trace)")
    p.add_argument("--memory-plot", type=Path, default=None, help="write the best plan's memory over the step (PNG)")


def load_model(text: str) -> ModelSpec:
    """A ModelSpec from what ``--model`` accepts: an HF config .json, a published architecture
    (``llama3-8b``), ``module:factory`` imported from the current directory (returning
    ``(model, example_inputs)`` as for ``pass-debug``, or a ModelSpec or HF config), or a zoo name.
    ValueError names what was tried."""
    path = Path(text)
    if text.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ValueError(f"--model {text}: no such file")
        return from_hf_config(json.loads(path.read_text()), name=path.stem)
    if text in PRESETS:
        return PRESETS[text]
    # NOTE: building a model imports torch; the simulator alone does not
    from meshfold.tools.common import call_factory, is_model_and_inputs, load_zoo
    from meshfold.tools.plan_spec import spec_of

    if ":" in text:
        made = call_factory(text, "meshfold plan")
        return spec_of(made[0] if is_model_and_inputs(made) else made, text)
    from meshfold.tools.zoo import zoo_names

    if text in zoo_names():
        return spec_of(load_zoo(text)[0], text)
    known = ", ".join([*sorted(PRESETS), *zoo_names()])
    raise ValueError(f"--model {text}: not a .json file, module:factory, or known model ({known})")


def _search(
    spec: ModelSpec, cluster: Cluster, train: TrainSpec, mesh: dict[str, int] | None, top: int, quiet: bool
) -> list[Ranked]:
    """``search_configs``, with a live count of configurations examined on a terminal's stderr."""
    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        return search_configs(spec, cluster, train, mesh=mesh, top=top)
    with console.status(f"searching plans for {spec.name} on {cluster}") as status:
        return search_configs(
            spec,
            cluster,
            train,
            mesh=mesh,
            top=top,
            progress=lambda n: status.update(f"searching plans for {spec.name} on {cluster}: {n:,} examined"),
        )


def _pairs(text: str, flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, eq, val = part.strip().partition("=")
        if not eq or not key:
            raise ValueError(f"{flag} {text!r}: write key=value pairs separated by commas, e.g. tp=8,pp=2,dp=4")
        out[key.strip()] = int(val) if val.strip().lstrip("-").isdigit() else val.strip()
    return out


def run(args: argparse.Namespace, console: Console) -> int:
    """Search (or evaluate ``--fixed``) and print the table or the JSON object."""
    spec = load_model(args.model)
    if args.routing_imbalance is not None:
        spec = replace(spec, routing_imbalance=args.routing_imbalance)
    console = Console(width=max(console.width, 180 if spec.num_experts else 150))
    mesh_pins = _pairs(args.mesh, "--mesh") if args.mesh else None
    # NOTE: a cluster file measured on another rank count is re-sized to a pinned mesh's ranks
    sizes = [v for v in (mesh_pins or {}).values() if isinstance(v, int)]
    world = math.prod(sizes) if mesh_pins and len(sizes) == len(mesh_pins) else None
    cluster = load_cluster(args.cluster, world)
    train = TrainSpec(seq_len=args.seq, global_batch=args.global_batch, dtype=args.dtype)
    start = time.perf_counter()
    if args.fixed:
        pins = _pairs(args.fixed, "--fixed")
        try:
            cfg = ParallelConfig(**pins)
        except TypeError as e:
            raise ValueError(f"--fixed {args.fixed!r}: {e}") from e
        try:
            cfg.validate(spec, cluster, train)
        except ConfigError as e:
            raise ValueError(f"--fixed {args.fixed!r}: {e}") from e
        ranked = [(cfg, simulate(spec, cluster, cfg, train))]
    else:
        found = _search(spec, cluster, train, mesh_pins, args.top, quiet=args.json)
        if not found:
            raise ValueError(
                f"no plan for {spec.name} fits {cluster.device.name}'s {cluster.device.hbm_bytes / GIB:.0f} GiB on "
                f"{cluster}; use more devices, a smaller global batch or sequence, or another mesh"
            )
        ranked = [(r.config, r.result) for r in found]
    solve_s = time.perf_counter() - start
    best_cfg, best = ranked[0]
    if args.trace or args.memory_plot:
        best = simulate(spec, cluster, best_cfg, train)
    if args.trace:
        args.trace.write_text(json.dumps(to_chrome_trace(best)))
    if args.memory_plot:
        plot_memory(best, args.memory_plot)
    if args.json:
        print(json.dumps(_row(best_cfg, best, solve_s), sort_keys=True))
        return 0
    _table(console, spec, cluster, train, ranked, solve_s)
    return 0


def _row(cfg: ParallelConfig, res: SimResult, solve_s: float) -> dict[str, Any]:
    return {
        "plan": cfg.describe(),
        "step_time_s": res.step_time_s,
        "mfu": res.mfu,
        "tflops_per_device": res.tflops_per_device,
        "tokens_per_s": res.tokens_per_s,
        "peak_memory_bytes": res.peak_memory_bytes,
        "exposed_comm_s": res.exposed_comm_s,
        "a2a_bytes": res.a2a_bytes,
        "a2a_exposed_s": res.a2a_exposed_s,
        "solve_time_s": solve_s,
        "fits": res.fits,
        "schedule": cfg.schedule_name,
        "stage_layers": list(res.stage_layers),
    }


def _table(
    console: Console,
    spec: ModelSpec,
    cluster: Any,
    train: TrainSpec,
    ranked: list[tuple[ParallelConfig, SimResult]],
    solve_s: float,
) -> None:
    title = (
        f"{spec.name} ({spec.param_count() / 1e9:.2f} B params) on {cluster}, seq {train.seq_len}, "
        f"global batch {train.global_batch}, {train.dtype}"
    )
    t = Table(title=title)
    moe = bool(spec.num_experts)
    cols = ["#", "plan", "step (s)", "MFU", "TFLOP/s/dev", "tokens/s", "peak mem (GiB)", "exposed comm (s)"]
    cols += ["a2a/dev (GiB)", "a2a exposed (s)"] if moe else []
    for col in cols:
        t.add_column(col, justify="left" if col == "plan" else "right")
    for i, (cfg, r) in enumerate(ranked, 1):
        cells = [
            str(i),
            cfg.describe(),
            f"{r.step_time_s:.3f}",
            f"{100 * r.mfu:.1f}%",
            f"{r.tflops_per_device:.1f}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.peak_memory_bytes / GIB:.1f}",
            f"{r.exposed_comm_s:.3f}",
        ]
        cells += [f"{r.a2a_bytes / GIB:.2f}", f"{r.a2a_exposed_s:.3f}"] if moe else []
        t.add_row(*cells)
    console.print(t)
    for i, (_, r) in enumerate(ranked, 1):
        if r.stages_text():
            console.print(f"plan {i} pipeline: {r.stages_text()}")
        if not r.fits:
            console.print(f"[red]plan {i} does not fit: {r.peak_memory_bytes / GIB:.1f} GiB per device[/red]")
    console.print(f"solve time: {solve_s:.2f} s")
