"""The ``meshfold`` command. ``meshfold demo`` is the README's main job."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from meshfold.tools import plan_cli

# NOTE: `meshfold plan` runs the pure-Python simulator; torch and the compiler load only for the
# commands that need them (see _compiler()).
ZOO = (
    "deepseek-tiny",
    "gpt2-tiny",
    "hf-llama",
    "hf-mixtral",
    "llama-tiny",
    "mixtral-list-tiny",
    "mixtral-tiny",
    "moe-loop-tiny",
    "mlp",
)


def write_dumps(model_name: str, mesh: Any, plan: str, dump_dir: Path, moe: dict[str, Any] | None = None) -> Path:
    """Compile ``model_name`` for ``mesh`` in this process and dump every pass (text, dot, html);
    ``moe`` is the expert mapping, as ``parallelize(..., moe=)`` takes it."""
    from meshfold import DEFAULT_PIPELINE, capture
    from meshfold.moe import MoeSpec, plan_with_experts, with_spec
    from meshfold.passes import PassContext, PassPipeline
    from meshfold.passes.sharding.plans import Plan
    from meshfold.tools.dumps import DumpWriter
    from meshfold.tools.zoo import build

    pipeline = PassPipeline.parse(DEFAULT_PIPELINE)
    model, inputs = build(model_name)
    spec = MoeSpec.of(moe) if moe is not None else None
    graph = capture(model, inputs, moe=spec)
    the_plan = Plan.of(plan)
    if spec is not None:
        graph = with_spec(graph, spec)
        the_plan = plan_with_experts(the_plan, spec, graph, mesh)
    writer = DumpWriter(dump_dir, pipeline, title=f"{model_name} on {mesh}, plan {plan}")
    writer.write_step(graph)
    try:
        pipeline.run(PassContext(mesh=mesh, plan=the_plan), graph, lambda i, p, g: writer.write_step(g))
    finally:
        index = writer.write_index()
    return index


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshfold`` console script."""
    ap = argparse.ArgumentParser(prog="meshfold", description="Compile single-device PyTorch models for meshes.")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a built-in model on local CPU ranks beside the single-device model")
    d.add_argument("--model", default="llama-tiny", choices=ZOO)
    d.add_argument("--mesh", default="dp=2,tp=2", help="named mesh, e.g. dp=2,tp=2 (its size = number of ranks)")
    d.add_argument("--plan", default=None, help="preset such as fsdp+tp (default: from the mesh's axis names)")
    d.add_argument("--steps", type=int, default=20)
    d.add_argument("--dump-dir", type=Path, default=Path("dumps"))
    d.add_argument(
        "--moe",
        default="auto",
        help="expert mapping for MoE models: auto (EP over the most ranks that divide the experts), off, or ep=N",
    )
    plan_cli.add_arguments(sub.add_parser("plan", help="rank parallel plans for a model on a cluster (simulated)"))
    args = ap.parse_args(argv)
    console = Console()
    if args.command == "plan":
        try:
            return plan_cli.run(args, console)
        except ValueError as e:
            print(f"meshfold plan: {e}", file=sys.stderr)
            return 2
    from meshfold import CaptureError, ir
    from meshfold.passes import PassError
    from meshfold.passes.sharding.plans import default_preset
    from meshfold.tools.demo import run_demo
    from meshfold.tools.pass_debug import CliError

    try:
        mesh = ir.Mesh.parse(args.mesh)
        plan = args.plan or default_preset(mesh)
        moe = _moe_option(args.moe, args.model, mesh)
        index = write_dumps(args.model, mesh, plan, args.dump_dir, moe)
        console.print(f"pass dumps: {index.resolve()}")
        return run_demo(args.model, args.mesh, plan, args.steps, args.dump_dir, moe=moe)
    except (PassError, CaptureError, ValueError, CliError) as e:
        print(f"meshfold: {e}", file=sys.stderr)
        return 2


def _moe_option(text: str, model_name: str, mesh: Any) -> dict[str, Any] | None:
    """``--moe``: ``auto`` (see ``tools.demo.default_moe``), ``off``, or a spec such as ``ep=2``."""
    from meshfold.tools.demo import default_moe
    from meshfold.tools.pass_debug import moe_items, parse_moe

    if text == "auto":
        return default_moe(model_name, mesh)
    if text == "off":
        return None
    parse_moe(text)  # NOTE: refuses a malformed spec here, before anything is captured or spawned
    return moe_items(text)


if __name__ == "__main__":
    raise SystemExit(main())
