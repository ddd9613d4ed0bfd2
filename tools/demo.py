"""``meshfold demo``: train a zoo model for N steps on local CPU ranks beside the single-device model.

A model with routed experts meshfold folds (mixtral-tiny, deepseek-tiny) gets its own expert mapping
of the same ranks: expert parallelism over as many innermost mesh axes as divide every layer's
expert count (all ranks where they do), the rest replicating the experts.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_MESH = "dp=2,tp=2"


def auto_ep(mesh: Any, expert_counts: list[int]) -> int:
    """The largest EP a run of innermost mesh axes gives that divides every layer's expert count
    (``meshfold.moe.MoeSpec`` maps EP onto whole axes, innermost first); 1 when none does."""
    best, ranks = 1, 1
    for size in reversed(mesh.sizes):
        ranks *= size
        if all(n % ranks == 0 for n in expert_counts):
            best = ranks
    return best


def default_moe(model_name: str, mesh: Any) -> dict[str, Any] | None:
    """``moe=`` for the demo: ``{"ep": auto_ep(...)}`` when the model has experts meshfold folds and
    that splits them (EP > 1), else None (the experts, if any, follow the plan)."""
    from meshfold.moe import find_experts
    from meshfold.moe_lists import expert_lists
    from meshfold.tools.zoo import build

    model = build(model_name)[0]
    sites, _ = find_experts(model)
    counts = [s.num_experts for s in sites] + [len(experts) for experts in expert_lists(model).values()]
    ep = auto_ep(mesh, counts) if counts else 1
    return {"ep": ep} if ep > 1 else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reference_losses(model_name: str, steps: int, lr: float) -> list[float]:
    from meshfold.tools.zoo import build

    model, inputs = build(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _rank_main(rank: int, world: int, port: int, args: dict[str, Any], queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from meshfold.api import parallelize
        from meshfold.passes.sharding.report import comm_summary
        from meshfold.tools.zoo import build

        names, sizes = args["names"], args["sizes"]
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        model, inputs = build(args["model"])
        pm = parallelize(model, mesh, inputs, plan=args["plan"], moe=args["moe"])
        opt = torch.optim.AdamW(pm.parameters(), lr=args["lr"])
        losses = []
        for _ in range(args["steps"]):
            opt.zero_grad()
            loss = pm(*inputs)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if rank == 0:
            graph = pm.graph()
            Path(args["dump_dir"]).mkdir(parents=True, exist_ok=True)
            (Path(args["dump_dir"]) / "parallel.txt").write_text(str(graph))
            layouts = [(i.name, str(i.value.layout)) for i in graph.inputs if i.kind == "param"]
            comms = [(c.op, c.axis, c.phase, c.count, c.bytes_per_rank) for c in comm_summary(graph)]
            queue.put({"losses": losses, "layouts": layouts, "comms": comms})
    finally:
        dist.destroy_process_group()


def run_demo(
    model_name: str,
    mesh_text: str,
    plan: str,
    steps: int,
    dump_dir: Path,
    lr: float = 1e-3,
    moe: dict[str, Any] | None = None,
) -> int:
    """Spawn the mesh's ranks, train, print the plan summary and per-step losses; 0 when they match.
    ``moe``: the expert mapping passed to ``parallelize`` (None: experts follow the plan)."""
    from rich.console import Console
    from rich.table import Table

    from meshfold import ir
    from meshfold.moe import MoeSpec
    from meshfold.passes.sharding.plans import Plan
    from meshfold.tools.pass_debug import mapping_line

    mesh = ir.Mesh.parse(mesh_text)
    console = Console()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    args = {
        "model": model_name,
        "names": mesh.names,
        "sizes": mesh.sizes,
        "plan": plan,
        "steps": steps,
        "lr": lr,
        "dump_dir": str(dump_dir),
        "moe": moe,
    }
    console.print(
        f"[bold]meshfold demo[/bold]: {model_name}, plan {plan}, {mesh} on {mesh.world_size} CPU ranks (gloo)"
    )
    if moe is not None:
        console.print(mapping_line(Plan.of(plan), mesh, MoeSpec.of(moe)))
    mp.start_processes(
        _rank_main,
        args=(mesh.world_size, _free_port(), args, queue),
        nprocs=mesh.world_size,
        join=True,
        start_method="spawn",
    )
    result = queue.get()
    reference = _reference_losses(model_name, steps, lr)

    layouts = Table(title="parameter layouts (stored)")
    layouts.add_column("parameter")
    layouts.add_column("layout")
    for name, lay in result["layouts"]:
        layouts.add_row(name, lay if lay != "{}" else "replicated")
    console.print(layouts)
    comms = Table(title="collectives per training step (per rank)")
    for col in ("collective", "axis", "phase", "count", "MiB sent"):
        comms.add_column(col, justify="right" if col in ("count", "MiB sent") else "left")
    total = 0.0
    for op, axis, phase, count, sent in result["comms"]:
        comms.add_row(op, axis, phase, str(count), f"{sent / 2**20:.3f}")
        total += sent
    console.print(comms)
    console.print(f"bytes sent per rank per step: {total / 2**20:.3f} MiB")
    steps_table = Table(title="loss per step")
    for col in ("step", "meshfold", "single device", "|diff|"):
        steps_table.add_column(col, justify="right")
    worst = 0.0
    for i, (a, b) in enumerate(zip(result["losses"], reference, strict=True)):
        worst = max(worst, abs(a - b))
        steps_table.add_row(str(i + 1), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.1e}")
    console.print(steps_table)
    console.print(f"compiled graph of rank 0: {dump_dir.resolve() / 'parallel.txt'}")
    ok = worst <= 1e-4 * max(1.0, abs(reference[0]))
    console.print("[green]matches single-device training[/green]" if ok else "[red]differs from single device[/red]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_demo("llama-tiny", DEFAULT_MESH, "fsdp+tp", 20, Path("dumps")))
