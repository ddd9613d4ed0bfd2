"""``pass-debug``: run a pass pipeline on a model or an IR file and show the graph between passes.

    pass-debug mlp -p cleanup,verify --print-after cleanup
    pass-debug graph.ir --dump-dir dumps --time-passes
    pass-debug my_models:make_model --mesh dp=2,tp=2 --verify
    pass-debug mixtral-tiny --mesh dp=2,tp=2 --moe ep=4

MODEL is a zoo name, ``module:factory`` (the factory returns ``(model, example_inputs)``; the module
is imported from the current directory) or a path to an IR text file. User errors print one line on
stderr and exit with code 2. A graph with routed experts (``meshfold.moe_experts``) also gets a
table of the two mappings, attention's (the plan's axis roles) and the experts' (``--moe``: EP and
EDP axes), and of the mesh layout every experts op computes with.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from meshfold import ir
from meshfold.passes import Pass, PassError, PassFailure, PassPipeline, PassTiming, default_registry, pass_spelling
from meshfold.passes.memory.activations import memory_line
from meshfold.passes.options import Options
from meshfold.passes.schedule.timeline import predicted, to_chrome_trace, write_trace
from meshfold.passes.sharding.ilp.problem import attention_lines, step_line
from meshfold.pp.stage_plan import pipeline_line
from meshfold.rewrites.capture_passes import CAPTURE_PASSES, CapturePass, capture_pipeline
from meshfold.session import compile_model, progress
from meshfold.tools.common import CliError, load_source, moe_tables, parse_mesh, parse_moe, show_progress
from meshfold.tools.dumps import DumpWriter, phase_counts
from meshfold.tracing.tracer import CaptureError

EXIT_ERROR = 2


def _arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pass-debug",
        description="Run a meshfold pass pipeline and show the graph between passes. Every option "
        "parallelize() takes is a flag here, so any compilation can be replayed from the shell.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from meshfold.tools.zoo import zoo_names

    p.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help=f"a zoo model ({', '.join(zoo_names())}), module:factory, or a path to an IR text file",
    )
    for f in Options.flags():
        flag = f.metadata["flag"] or f"--{f.name.replace('_', '-')}"
        names = ("-p", flag) if f.name == "pipeline" else (flag,)
        p.add_argument(*names, dest=f.name, default=f.default, metavar=f.metadata["metavar"], help=f.metadata["help"])
    p.add_argument(
        "--assume",
        default="",
        metavar="PROPS",
        help="graph properties an IR file already has, e.g. sharded or boxed (comma-separated)",
    )
    p.add_argument("--print-after", action="append", default=[], metavar="NAME", help="print the IR after pass NAME")
    p.add_argument("--print-between-passes", action="store_true", help="print the input IR and the IR after each pass")
    p.add_argument("--print-result", action="store_true", help="print only the IR the pipeline ends with")
    p.add_argument("--time-passes", action="store_true", help="print per-pass wall time to stderr")
    p.add_argument("--verify", action="store_true", help="run the IR verifier on the input and after every pass")
    p.add_argument("--dump-dir", type=Path, metavar="DIR", help="write txt/dot/svg/html dumps of every step to DIR")
    p.add_argument(
        "--list-passes",
        action="store_true",
        help="list the capture passes (on dynamo's graph) and the IR passes, with their options, and exit",
    )
    p.add_argument("--no-color", action="store_true", help="plain output without colour")
    return p


def _verify(graph: ir.Graph, where: str) -> None:
    try:
        ir.verify(graph)
    except ir.VerifyError as e:
        raise CliError(f"verification failed {where}: {e}") from None


def _print_ir(header: str, graph: ir.Graph) -> None:
    # NOTE: a graph the printer cannot write (a value read before it is made) is a broken pass; say
    # which, as the verifier would, instead of a traceback from the printer
    try:
        text = str(graph)
    except ValueError:
        _verify(graph, header.replace("IR ", "", 1))
        raise
    print(f"// ----- {header} -----")
    print(text, end="", flush=True)


def _timing_table(timings: Sequence[PassTiming], passes: Sequence[Pass]) -> Table:
    total = sum(t.seconds for t in timings) or 1.0
    table = Table(title="pass timings")
    for column in ("#", "pass", "seconds", "share"):
        table.add_column(column, justify="left" if column == "pass" else "right")
    for i, (t, p) in enumerate(zip(timings, passes, strict=False), 1):
        table.add_row(str(i), pass_spelling(p), f"{t.seconds:.4f}", f"{100 * t.seconds / total:.1f}%")
    table.add_row("", "total", f"{sum(t.seconds for t in timings):.4f}", "100.0%")
    return table


def _summary(title: str, steps: Sequence[tuple[str, int, int]]) -> Table:
    table = Table(title=title)
    for column in ("step", "pass", "fwd ops", "bwd ops", "total"):
        table.add_column(column, justify="left" if column in ("step", "pass") else "right")
    for i, (spelling, fwd, bwd) in enumerate(steps):
        table.add_row(str(i), spelling, str(fwd), str(bwd), str(fwd + bwd))
    return table


def _solve_table(stats: Mapping[str, object]) -> Table | None:
    """The sharding solve's program per mesh axis, how far HiGHS got, and the modelled step time."""
    axes = stats.get("sharding.solve")
    if not isinstance(axes, tuple) or not axes:
        return None
    table = Table(title="sharding solve", caption=step_line(stats))
    for column in ("axis", "binaries", "columns", "rows", "shared ops", "nodes", "gap", "state"):
        table.add_column(column, justify="left" if column in ("axis", "state") else "right")
    for a in axes:
        state = "optimal" if a.optimal else "node limit"
        row = (a.axis, a.binaries, a.columns, a.rows, a.shared_ops, a.nodes, f"{100 * a.gap:.2f}%", state)
        table.add_row(*map(str, row))
    return table


def _overlap_line(stats: Mapping[str, object]) -> str | None:
    """The overlap pass's predicted communication, and how much of it the schedule leaves exposed."""
    s = stats.get("overlap")
    if not isinstance(s, dict):
        return None
    return (
        f"overlap: predicted step {1e3 * s['step_s']:.3f} ms (without overlap {1e3 * s['step_before_s']:.3f}); "
        f"communication {1e3 * s['comm_s']:.3f} ms, exposed {1e3 * s['exposed_s']:.3f} ms (was "
        f"{1e3 * s['exposed_before_s']:.3f}); at most {s['inflight_peak_bytes'] / 2**20:.2f} MiB in flight"
    )


def _passes_table() -> Table:
    """Every pass a compile can run, in the order capture runs them: the capture passes on dynamo's
    fx graph (``Options.capture``), then the IR passes a pipeline string names, with their options."""
    table = Table(title="passes")
    for column in ("stage", "pass", "options", "what it does"):
        table.add_column(column)
    for name, cls in CAPTURE_PASSES.items():
        table.add_row("capture", name, "", _first_sentence(cls.__doc__))
    for name, pcls in default_registry().items():
        opts = ", ".join(f"{f.name.replace('_', '-')}={f.default}" for f in dataclasses.fields(pcls))
        table.add_row("ir", name, opts, _first_sentence(pcls.__doc__))
    return table


def _first_sentence(doc: str | None) -> str:
    text = " ".join((doc or "").replace("``", "").split())
    return text.split(". ")[0].rstrip(".")


def options_from(args: argparse.Namespace, graph_mesh: ir.Mesh | None) -> Options:
    """The ``Options`` the flags spell (``--mesh`` defaults to the mesh an IR file declares)."""
    mesh = parse_mesh(args.mesh)
    if mesh is not None and graph_mesh is not None and mesh != graph_mesh:
        raise CliError(f"--mesh {mesh} differs from the {graph_mesh} the IR file declares; drop --mesh or match it")
    flags = {f.name: getattr(args, f.name) for f in Options.flags()}
    return Options.of(**{**flags, "mesh": mesh if mesh is not None else graph_mesh})


def _run(args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.list_passes:
        out.print(_passes_table())
        return 0
    if args.model is None:
        raise CliError("give a MODEL (a zoo name, module:factory or an IR file), or --list-passes")
    assume = frozenset(filter(None, (a.strip() for a in args.assume.split(","))))
    pipeline = PassPipeline.parse(args.pipeline)
    names = [p.name for p in pipeline.passes]
    captures = [p.name for p in capture_pipeline(args.capture)]
    for name in args.print_after:
        if name not in names and name not in captures:
            raise CliError(
                f"--print-after {name}: pipeline {pipeline} and capture passes {','.join(captures)} have no pass "
                f"named {name!r}"
            )
    if args.dump_dir is not None and args.dump_dir.exists() and not args.dump_dir.is_dir():
        raise CliError(f"--dump-dir {args.dump_dir} exists and is not a directory; pass a directory path")
    if args.mesh is not None:
        parse_mesh(args.mesh)
    if args.moe is not None:
        parse_moe(args.moe)  # NOTE: a malformed spec is refused before the model is loaded
    (source, inputs), label = load_source(args.model)
    options = options_from(args, source.mesh if isinstance(source, ir.Graph) else None)
    options.check(assume)
    writer = DumpWriter(args.dump_dir, pipeline, title=label) if args.dump_dir is not None else None
    printing = bool(args.print_between_passes or args.print_after or args.print_result)
    n = len(pipeline.passes)
    steps: list[tuple[str, int, int]] = []
    first: list[ir.Graph] = []

    def before(graph: ir.Graph) -> None:
        first.append(graph)
        if args.verify:
            _verify(graph, f"on the input graph ({label})")
        if args.print_between_passes:
            _print_ir(f"IR before the pipeline (input, {label})", graph)
        if writer is not None:
            writer.write_step(graph)
        steps.append(("input", *phase_counts(graph)))

    def after_capture(i: int, p: CapturePass, text: str) -> None:
        where = f"capture pass {i + 1} of {len(captures)} ({p.name})"
        if args.print_between_passes or p.name in args.print_after:
            print(f"// ----- fx graph after {where} -----")
            print(text, end="" if text.endswith("\n") else "\n", flush=True)
        if writer is not None:
            writer.write_capture(i, p.name, text)

    def after_pass(i: int, p: Pass, g: ir.Graph) -> None:
        where = f"pass {i + 1} of {n} ({pass_spelling(p)})"
        if args.verify:
            _verify(g, f"after {where}")
        if args.print_between_passes or p.name in args.print_after:
            _print_ir(f"IR after {where}", g)
        if writer is not None:
            writer.write_step(g)
        steps.append((pass_spelling(p), *phase_counts(g)))

    try:
        try:
            result = compile_model(
                source,
                inputs,
                options,
                callback=after_pass,
                before=before,
                assume=assume,
                status=progress(),
                after_capture=after_capture,
            )
        except CaptureError as e:
            raise CliError(f"cannot capture {label}: {e}") from None
        except PassFailure as e:
            raise CliError(f"{e.args[0].replace(f'pass {e.index + 1} ', f'pass {e.index + 1} of {n} ', 1)}") from None
    finally:
        if writer is not None and writer.records:
            writer.write_index()
    if args.print_result:
        print(str(result.graph), end="", flush=True)
    if result.options.trace is not None:
        if result.graph.mesh is None:
            raise CliError("--trace needs a compiled program: give --mesh (and a pipeline with sharding)")
        tl = predicted(result.graph, result.options.cluster)
        write_trace(to_chrome_trace(tl), result.options.trace)
        err.print(
            f"trace: {result.options.trace} (predicted step {1e3 * tl.step:.3f} ms, communication "
            f"{1e3 * tl.comm_total:.3f} ms, exposed {1e3 * tl.exposed_total:.3f} ms); open it in https://ui.perfetto.dev"
        )
    if args.time_passes:
        err.print(_timing_table(result.timings, result.pipeline.passes))
    if not printing:
        mesh = result.options.mesh or (source.mesh if isinstance(source, ir.Graph) else None)
        title = f"{label}: graph @{first[0].name}, {mesh or 'no mesh'}, pipeline {result.pipeline}"
        out.print(_summary(title, steps))
        plan = result.options.effective_plan() if "sharding" in names else None
        for table in moe_tables(result.graph, plan, mesh, result.options.moe):
            out.print(table)
        cp = attention_lines(result.stats)
        staged = pipeline_line(result.staged) if result.staged is not None else None
        for line in (memory_line(result.stats), _overlap_line(result.stats), *cp, staged):
            if line:
                out.print(line)
        solve = _solve_table(result.stats)
        if solve is not None:
            out.print(solve)
        if writer is not None:
            out.print(f"dumps: {len(writer.records)} steps in {args.dump_dir}; open {args.dump_dir / 'index.html'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pass-debug``; returns the exit code (0 on success, 2 on a user error)."""
    parser = _arg_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    out = Console(file=sys.stdout, no_color=args.no_color, highlight=False, soft_wrap=True)
    err = Console(file=sys.stderr, no_color=args.no_color, highlight=False, soft_wrap=True)
    show_progress()
    try:
        return _run(args, out, err)
    except (CliError, PassError, ir.ParseError, ir.VerifyError) as e:
        print(f"pass-debug: error: {e}", file=sys.stderr)
    except OSError as e:
        print(f"pass-debug: error: cannot write {e.filename or 'output'}: {e.strerror or e}", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
