"""The ``meshfold`` command. ``meshfold demo`` is the README's main job."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from backends.interpret import interpret
from compiler import DEFAULT_PIPELINE, CaptureError, capture
from compiler.zoo import build, zoo_names
from passes import PassContext, PassError, PassPipeline
from tools.dumps import DumpWriter


def demo(model_name: str, pipeline_text: str, dump_dir: Path, console: Console) -> int:
    """Capture a zoo model, run the pipeline with dumps, check the result against eager PyTorch."""
    pipeline = PassPipeline.parse(pipeline_text)
    pipeline.check()
    model, inputs = build(model_name)
    start = time.perf_counter()
    graph = capture(model, inputs)
    capture_s = time.perf_counter() - start
    writer = DumpWriter(dump_dir, pipeline, title=model_name)
    writer.write_step(graph)
    try:
        final, timings = pipeline.run(PassContext(), graph, lambda i, p, g: writer.write_step(g))
    finally:
        writer.write_index()

    loss = model(*inputs)
    loss.backward()
    feeds = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    feeds |= {i.name: x for i, x in zip([i for i in final.inputs if i.kind == "input"], inputs, strict=True)}
    got = interpret(final, feeds)
    worst = max(
        float((got[("grad", n)] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12))
        for n, p in model.named_parameters()
        if p.grad is not None
    )

    table = Table(title=f"meshfold demo: {model_name}", show_header=True)
    for col in ("step", "fwd ops", "bwd ops", "total", "time"):
        table.add_column(col, justify="left" if col == "step" else "right")
    times = [f"{capture_s:.2f} s"] + [f"{t.seconds:.3f} s" for t in timings]
    for rec, t in zip(writer.records, times, strict=True):
        table.add_row(
            rec.spelling if rec.index else "capture", str(rec.fwd_ops), str(rec.bwd_ops), str(rec.total_ops), t
        )
    console.print(table)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(f"parameters      {n_params:,} in {len(list(model.parameters()))} tensors")
    console.print(f"loss            graph {got[('out', '0')].item():.6f}  eager {loss.item():.6f}")
    console.print(f"gradients       worst relative difference to eager autograd: {worst:.2e}")
    console.print(f"dumps           {dump_dir.resolve()}/index.html ({len(writer.records)} steps: txt, dot, html)")
    ok = torch.allclose(got[("out", "0")], loss.detach(), rtol=1e-5, atol=1e-6) and worst < 1e-4
    if not ok:
        console.print("[red]the compiled graph does not match eager PyTorch[/red]")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshfold`` console script."""
    ap = argparse.ArgumentParser(prog="meshfold", description="Compile single-device PyTorch models for meshes.")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="capture a built-in model, run the default pipeline, write dumps")
    d.add_argument("--model", default="llama-tiny", choices=zoo_names())
    d.add_argument("-p", "--pipeline", default=DEFAULT_PIPELINE)
    d.add_argument("--dump-dir", type=Path, default=Path("dumps"))
    args = ap.parse_args(argv)
    console = Console()
    try:
        return demo(args.model, args.pipeline, args.dump_dir, console)
    except (PassError, CaptureError) as e:
        print(f"meshfold: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
