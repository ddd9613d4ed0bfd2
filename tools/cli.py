"""The ``meshfold`` command. ``meshfold demo`` is the README's main job."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from meshfold import __version__
from meshfold.tools import plan_cli

# NOTE: `meshfold plan` runs the pure-Python simulator; torch and the compiler load only for the
# commands that need them.


def write_dumps(
    model_name: str,
    mesh: Any,
    plan: str,
    dump_dir: Path,
    moe: dict[str, Any] | None = None,
    precision: str | None = None,
) -> Path:
    """Compile ``model_name`` for ``mesh`` in this process (the one compile path, as ``parallelize``
    does on rank 0) and dump every step (text, dot, html); ``moe`` is the expert mapping and
    ``precision`` the mixed-precision policy, as ``parallelize`` takes them."""
    from meshfold.passes.options import Options
    from meshfold.session import compile_model
    from meshfold.tools.dumps import DumpWriter
    from meshfold.tools.zoo import build

    options = Options.of(mesh=mesh, plan=plan, moe=moe, precision=precision)
    model, inputs = build(model_name)
    writer = DumpWriter(dump_dir, options.check(), title=f"{model_name} on {mesh}, plan {plan}")
    try:
        compile_model(model, inputs, options, before=writer.write_step, callback=lambda i, p, g: writer.write_step(g))
    finally:
        index = writer.write_index()
    return index


def _zoo_names() -> list[str]:
    """The zoo's models (reading the registry imports torch, so only the commands that run one ask)."""
    from meshfold.tools.zoo import zoo_names

    return zoo_names()


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """What a command that runs a zoo model on local CPU ranks takes: the model, the mesh, the plan."""
    p.add_argument("--model", default="llama-tiny", help="a zoo model (`pass-debug --help` lists them)")
    p.add_argument("--mesh", default="dp=2,tp=2", help="named mesh, e.g. dp=2,tp=2 (its size = number of ranks)")
    p.add_argument("--plan", default=None, help="preset such as fsdp+tp; None: the one the mesh's axis names imply")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshfold`` console script."""
    ap = argparse.ArgumentParser(prog="meshfold", description="Compile single-device PyTorch models for meshes.")
    ap.add_argument("--version", action="version", version=f"meshfold {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="train a built-in model on local CPU ranks beside the single-device model",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _model_arguments(d)
    d.add_argument("--steps", type=int, default=20, help="training steps")
    d.add_argument("--dump-dir", type=Path, default=Path("dumps"), help="where the pass dumps go")
    d.add_argument(
        "--backend",
        default="eager",
        choices=("eager", "inductor"),
        help="how each rank's program runs: op by op, or compiled by Inductor (C++ kernels on CPU)",
    )
    d.add_argument(
        "--precision",
        default=None,
        help="mixed precision policy, e.g. bf16 (bf16 compute and all-gathers, fp32 gradient reduction)",
    )
    d.add_argument(
        "--moe",
        default="auto",
        help="expert mapping for MoE models: auto (EP over the most ranks that divide the experts), off, or ep=N",
    )
    e = sub.add_parser(
        "export-onnx",
        help="write each rank's forward program of a built-in model as ONNX, checked against the program",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _model_arguments(e)
    e.add_argument("--out", type=Path, default=Path("onnx"), help="where rank{R}.onnx go")
    e.add_argument("--moe", default="off", help="expert mapping for MoE models: off, or ep=N (EP is refused)")
    plan_cli.add_arguments(
        sub.add_parser(
            "plan",
            help="rank parallel plans for a model on a cluster (simulated)",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
    from meshfold.tools.calibrate import entry as calibrate

    calibrate.add_arguments(
        sub.add_parser(
            "calibrate",
            help="measure the time model's figures on local CPU ranks (or under torchrun) and write a cluster file",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
    from meshfold.tools.corpus import command as corpus

    corpus.add_arguments(
        sub.add_parser(
            "corpus",
            help="the differential corpus: real model code under every plan family against one device",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
    args = ap.parse_args(argv)
    console = Console()
    # NOTE: the commands whose bad input is a ValueError, said in one line
    plain = {"corpus": corpus.run, "calibrate": calibrate.run, "plan": plan_cli.run}
    if args.command in plain:
        try:
            return plain[args.command](args, console)
        except ValueError as e:
            print(f"meshfold {args.command}: {e}", file=sys.stderr)
            return 2
    from meshfold import CaptureError, ir
    from meshfold.passes import PassError
    from meshfold.passes.sharding.plans import effective_plan
    from meshfold.tools.common import CliError, show_progress
    from meshfold.tools.demo import run_demo

    show_progress()
    try:
        if args.model not in _zoo_names():
            raise CliError(f"unknown model {args.model!r}; zoo models: {', '.join(_zoo_names())}")
        mesh = ir.Mesh.parse(args.mesh)
        plan = args.plan or effective_plan(None, mesh).preset
        moe = _moe_option(args.moe, args.model, mesh)
        if args.command == "export-onnx":
            from meshfold.tools.export_onnx import run_export

            return run_export(args.model, args.mesh, plan, args.out, moe)
        precision = getattr(args, "precision", None)
        index = write_dumps(args.model, mesh, plan, args.dump_dir, moe, precision)
        console.print(f"pass dumps: {index.resolve()}")
        return run_demo(
            args.model, args.mesh, plan, args.steps, args.dump_dir, moe=moe, backend=args.backend, precision=precision
        )
    except (PassError, CaptureError, ValueError, CliError) as e:
        print(f"meshfold: {e}", file=sys.stderr)
        return 2


def _moe_option(text: str, model_name: str, mesh: Any) -> dict[str, Any] | None:
    """``--moe``: ``auto`` (see ``tools.demo.default_moe``), ``off``, or a spec such as ``ep=2``."""
    from meshfold.tools.common import moe_items, parse_moe
    from meshfold.tools.demo import default_moe

    if text == "auto":
        return default_moe(model_name, mesh)
    if text == "off":
        return None
    parse_moe(text)  # NOTE: refuses a malformed spec here, before anything is captured or spawned
    return moe_items(text)


if __name__ == "__main__":
    raise SystemExit(main())
