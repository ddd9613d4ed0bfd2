"""``meshfold export-onnx``: compile a zoo model on local CPU ranks, write each rank's forward program
as an ONNX file, and check every file against the compiled program it came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshfold.tools.ranks import Reporter, Stages, on_ranks


def _export(rank: int, args: dict[str, Any], report: Reporter) -> None:
    """One rank (``tools.ranks.on_ranks``): compile, export, run the file beside the program."""
    import onnx
    from torch.distributed.device_mesh import init_device_mesh

    from meshfold.api import parallelize
    from meshfold.backends.onnx import DOMAIN
    from meshfold.passes import PassError
    from meshfold.runtime.onnx_export import check_onnx
    from meshfold.tools.zoo import build

    mesh = init_device_mesh("cpu", args["sizes"], mesh_dim_names=args["names"])
    model, inputs = build(args["model"])
    report.stage(f"compiling {args['model']} with plan {args['plan']}")
    pm = parallelize(model, mesh, inputs, plan=args["plan"], moe=args["moe"])
    report.stage("exporting each rank's forward program")
    try:
        path = pm.export_onnx(args["out"])
    except (PassError, ValueError) as e:
        # NOTE: every rank refuses alike (the same program, the same op): nothing was written
        report.result({"error": str(e)})
        return
    report.stage("running each rank's file with onnx's reference evaluator")
    diff = check_onnx(pm, path, inputs)
    nodes = onnx.load(str(path)).graph.node
    collectives = sum(1 for n in nodes if n.domain == DOMAIN)
    report.result(
        {"path": str(path), "bytes": path.stat().st_size, "nodes": len(nodes), "collectives": collectives, "diff": diff}
    )


def run_export(model_name: str, mesh_text: str, plan: str, out: Path, moe: dict[str, Any] | None = None) -> int:
    """Spawn the mesh's ranks, export and check each rank's forward program, print one row per rank;
    0 when every file's outputs equal its program's (to 1e-5)."""
    from rich.console import Console
    from rich.table import Table

    from meshfold import ir

    mesh = ir.Mesh.parse(mesh_text)
    console = Console()
    console.print(
        f"[bold]meshfold export-onnx[/bold]: {model_name}, plan {plan}, {mesh} on {mesh.world_size} CPU ranks"
    )
    args = {"model": model_name, "names": mesh.names, "sizes": mesh.sizes, "plan": plan, "moe": moe, "out": str(out)}
    with Stages(console, "meshfold export-onnx") as stages:
        results = on_ranks(_export, mesh.world_size, args, stages)
    errors = {r["error"] for r in results.values() if "error" in r}
    if errors:
        for error in sorted(errors):
            console.print(f"[red]meshfold export-onnx: {error}[/red]")
        return 2
    if len(results) != mesh.world_size:
        console.print(f"[red]{mesh.world_size - len(results)} ranks ended without writing their file[/red]")
        return 1
    table = Table(title=f"each rank's forward program as ONNX in {out.resolve()} (collectives: meshfold domain)")
    for col in ("rank", "file", "MiB", "nodes", "collectives", "max |onnx - compiled|"):
        table.add_column(col, justify="left" if col == "file" else "right")
    for rank in sorted(results):
        r = results[rank]
        table.add_row(
            str(rank),
            r["path"],
            f"{r['bytes'] / 2**20:.2f}",
            str(r["nodes"]),
            str(r["collectives"]),
            f"{r['diff']:.1e}",
        )
    console.print(table)
    ok = all(r["diff"] <= 1e-5 for r in results.values())
    console.print(
        "[green]every file computes what its rank's program does[/green]"
        if ok
        else "[red]a file differs from its program[/red]"
    )
    return 0 if ok else 1
