"""``meshfold demo``: train a zoo model for N steps on local CPU ranks beside the single-device model.

A model with routed experts meshfold folds (mixtral-tiny, deepseek-tiny) gets its own expert mapping
of the same ranks: expert parallelism over as many innermost mesh axes as divide every layer's
expert count (all ranks where they do), the rest replicating the experts.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from meshfold.tools.profiled_collectives import (
    CollectiveCall,
    CollectiveRecorder,
    CollectiveRow,
    group_labels,
    summarize,
)
from meshfold.tools.ranks import Reporter, Stages, on_ranks

DEFAULT_MESH = "dp=2,tp=2"


def auto_ep(mesh: Any, expert_counts: list[int]) -> int:
    """The largest EP a run of innermost mesh axes gives that divides every layer's expert count
    (``meshfold.tracing.moe_layers.MoeSpec`` maps EP onto whole axes, innermost first); 1 when none does."""
    best, ranks = 1, 1
    for size in reversed(mesh.sizes):
        ranks *= size
        if all(n % ranks == 0 for n in expert_counts):
            best = ranks
    return best


def default_moe(model_name: str, mesh: Any) -> dict[str, Any] | None:
    """``moe=`` for the demo: ``{"ep": auto_ep(...)}`` when the model has experts meshfold folds and
    that splits them (EP > 1), else None (the experts, if any, follow the plan)."""
    from meshfold.rewrites.moe_lists import expert_lists
    from meshfold.tools.zoo import build
    from meshfold.tracing.moe_layers import find_experts

    model = build(model_name)[0]
    sites, _ = find_experts(model)
    counts = [s.num_experts for s in sites] + [len(experts) for experts in expert_lists(model).values()]
    ep = auto_ep(mesh, counts) if counts else 1
    return {"ep": ep} if ep > 1 else None


def _reference_losses(model_name: str, steps: int, lr: float, precision: str | None = None) -> list[float]:
    """The single-device model's loss per step; under ``precision`` (a policy), each step computed
    with its parameters (and floating inputs) cast to the policy's dtype, the fp32 ones updated."""
    from meshfold.passes.precision import Precision
    from meshfold.tools.zoo import build

    policy = Precision.of(precision)
    model, inputs = build(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        if policy is None:
            loss = model(*inputs)
        else:
            low = {n: p.to(policy.param) for n, p in model.named_parameters()}
            cast = [x.to(policy.param) if x.is_floating_point() else x for x in inputs]
            loss = torch.func.functional_call(model, low, tuple(cast))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def measured_step(pm: Any, inputs: Sequence[Any], opt: Any) -> tuple[float, list[CollectiveCall]]:
    """One training step of ``pm`` that also records every collective the rank runs, by phase."""
    recorder = CollectiveRecorder()
    with recorder:
        opt.zero_grad()
        with recorder.phase("fwd"):
            loss = pm(*inputs)
        with recorder.phase("bwd"):
            loss.backward()
        with recorder.phase("optimizer"):
            opt.step()
    return float(loss.item()), recorder.calls


def profiled_step(pm: Any, inputs: Sequence[Any], opt: Any, path: Path) -> tuple[float, tuple[float, float]]:
    """One training step under ``torch.profiler``, its Chrome trace written to ``path``; returns the
    loss and (forward + backward seconds, seconds the rank spent waiting for collectives)."""
    from torch.profiler import ProfilerActivity, profile

    from meshfold.passes.schedule.timeline import write_trace

    opt.zero_grad()
    # NOTE: shapes let ``meshfold calibrate --from-profile`` count each matmul's FLOPs
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        loss = pm(*inputs)
        loss.backward()
        took = time.perf_counter() - start
    opt.step()
    waits = sum(e.time_range.elapsed_us() for e in prof.events() if e.name == "_c10d_functional::wait_tensor")
    tmp = path.with_name(path.name + ".part")
    prof.export_chrome_trace(str(tmp))
    write_trace(json.loads(tmp.read_text()), path)
    tmp.unlink()
    return float(loss.item()), (took, waits / 1e6)


def collectives_table(rows: Sequence[CollectiveRow]) -> tuple[Any, int, int]:
    """The demo's table of collectives per step (one row per kind, group and phase) and the total
    bytes in and out."""
    from rich.table import Table

    table = Table(title="collectives run per training step (rank 0, measured)")
    for col in ("collective", "group", "phase", "calls", "MiB in", "MiB out"):
        table.add_column(col, justify="left" if col in ("collective", "group", "phase") else "right")
    total_in = total_out = 0
    for r in rows:
        table.add_row(r.kind, r.group, r.phase, str(r.count), f"{r.in_bytes / 2**20:.3f}", f"{r.out_bytes / 2**20:.3f}")
        total_in += r.in_bytes
        total_out += r.out_bytes
    return table, total_in, total_out


def _train(rank: int, args: dict[str, Any], report: Reporter) -> None:
    """One rank of the demo (``tools.ranks.on_ranks``): compile, train, and on rank 0 report the run."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshfold.api import parallelize
    from meshfold.passes.schedule.timeline import predicted
    from meshfold.tools.zoo import build

    names, sizes = args["names"], args["sizes"]
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    model, inputs = build(args["model"])
    report.stage(f"compiling {args['model']} with plan {args['plan']}")
    dump = Path(args["dump_dir"])
    if rank == 0:
        dump.mkdir(parents=True, exist_ok=True)
    pm = parallelize(
        model,
        mesh,
        inputs,
        plan=args["plan"],
        moe=args["moe"],
        backend=args["backend"],
        precision=args["precision"],
        trace=dump / "step-predicted.json",
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=args["lr"])
    losses: list[float] = []
    calls: list[CollectiveCall] = []
    for i in range(args["steps"]):
        report.stage(f"training step {i + 1}/{args['steps']}")
        if i == 0:
            loss, calls = measured_step(pm, inputs, opt)
        elif i == 1 and rank == 0:
            loss, waited = profiled_step(pm, inputs, opt, dump / "step-measured.json")
        else:
            opt.zero_grad()
            out = pm(*inputs)
            out.backward()
            opt.step()
            loss = out.item()
        losses.append(loss)
    if rank == 0:
        graph = pm.graph()
        Path(args["dump_dir"]).mkdir(parents=True, exist_ok=True)
        (Path(args["dump_dir"]) / "parallel.txt").write_text(str(graph))
        layouts = [(i.name, str(i.value.layout)) for i in graph.inputs if i.kind == "param"]
        labels = group_labels(mesh, {c.group for c in calls})
        comms = summarize(calls, labels)
        tl = predicted(graph)
        timeline = {"predicted": (tl.step, tl.exposed_total), "measured": waited if args["steps"] > 1 else None}
        result = {"losses": losses, "layouts": layouts, "comms": comms, "solve": pm.plan_report()}
        result["timeline"] = timeline
        report.result(result)


def run_demo(
    model_name: str,
    mesh_text: str,
    plan: str,
    steps: int,
    dump_dir: Path,
    lr: float = 1e-3,
    moe: dict[str, Any] | None = None,
    backend: str = "eager",
    precision: str | None = None,
) -> int:
    """Spawn the mesh's ranks, train, print the plan summary, the collectives measured on rank 0 and the
    per-step losses; 0 when they match. ``moe``: the expert mapping passed to ``parallelize`` (None:
    experts follow the plan); ``backend`` and ``precision`` as ``parallelize`` takes them (under a
    precision policy the single-device run computes under it too, and the losses must agree to bf16's
    rounding, 2^-7 of the loss, instead of 1e-4). Each long stage shows on a
    terminal as a spinner, else as a line."""
    from rich.console import Console
    from rich.table import Table

    from meshfold import ir
    from meshfold.passes.sharding.plans import Plan
    from meshfold.tools.common import mapping_line
    from meshfold.tracing.moe_layers import MoeSpec

    mesh = ir.Mesh.parse(mesh_text)
    console = Console()
    args = {
        "model": model_name,
        "names": mesh.names,
        "sizes": mesh.sizes,
        "plan": plan,
        "steps": steps,
        "lr": lr,
        "dump_dir": str(dump_dir),
        "moe": moe,
        "backend": backend,
        "precision": precision,
    }
    console.print(
        f"[bold]meshfold demo[/bold]: {model_name}, plan {plan}, {mesh} on {mesh.world_size} CPU ranks (gloo), "
        f"{backend} backend" + (f", precision {precision}" if precision else "")
    )
    if moe is not None:
        console.print(mapping_line(Plan.of(plan), mesh, MoeSpec.of(moe)))
    with Stages(console, "meshfold demo") as stages:
        result = on_ranks(_train, mesh.world_size, args, stages)[0]
        stages(f"training the single-device model for {steps} steps")
        reference = _reference_losses(model_name, steps, lr, precision)

    layouts = Table(title="parameter layouts (stored)")
    layouts.add_column("parameter")
    layouts.add_column("layout")
    for name, lay in result["layouts"]:
        layouts.add_row(name, lay if lay != "{}" else "replicated")
    console.print(layouts)
    for line in result["solve"]:
        console.print(f"sharding solve: {line}")
    comms, total_in, total_out = collectives_table(result["comms"])
    console.print(comms)
    console.print(f"bytes per step on rank 0: {total_in / 2**20:.3f} MiB in, {total_out / 2**20:.3f} MiB out")
    steps_table = Table(title="loss per step")
    for col in ("step", "meshfold", "single device", "|diff|"):
        steps_table.add_column(col, justify="right")
    worst = 0.0
    for i, (a, b) in enumerate(zip(result["losses"], reference, strict=True)):
        worst = max(worst, abs(a - b))
        steps_table.add_row(str(i + 1), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.1e}")
    console.print(steps_table)
    console.print(f"compiled graph of rank 0: {dump_dir.resolve() / 'parallel.txt'}")
    (step_s, exposed_s), measured = result["timeline"]["predicted"], result["timeline"]["measured"]
    line = f"step 2 of rank 0: predicted {1e3 * step_s:.1f} ms with {1e3 * exposed_s:.1f} ms waiting on collectives"
    if measured is not None:
        line += f"; measured {1e3 * measured[0]:.1f} ms with {1e3 * measured[1]:.1f} ms waiting"
    console.print(f"{line} (traces: {dump_dir.resolve() / 'step-predicted.json'}, step-measured.json)")
    ok = worst <= (2.0**-7 if precision else 1e-4) * max(1.0, abs(reference[0]))
    console.print("[green]matches single-device training[/green]" if ok else "[red]differs from single device[/red]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_demo("llama-tiny", DEFAULT_MESH, "fsdp+tp", 20, Path("dumps")))
