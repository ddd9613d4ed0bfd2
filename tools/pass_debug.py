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
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshfold import ir
from meshfold.ir.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.passes import Pass, PassError, PassFailure, PassPipeline, PassTiming, pass_spelling
from meshfold.passes.moe.spec import MoeSpec
from meshfold.passes.sharding.plans import Plan, axis_roles
from meshfold.session import DEFAULT_PIPELINE, CompileOptions, compile_model, progress
from meshfold.tools.dumps import DumpWriter, phase_counts
from meshfold.tracer import CaptureError

EXIT_ERROR = 2
_IR_SUFFIXES = (".mlir", ".ir", ".txt")


class CliError(Exception):
    """A user error: shown as one line on stderr, exit code 2."""


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
        help=f"a zoo model ({', '.join(zoo_names())}), module:factory, or a path to an IR text file",
    )
    p.add_argument("-p", "--pipeline", default=DEFAULT_PIPELINE, help="pass pipeline")
    p.add_argument("--mesh", metavar="MESH", help="device mesh, e.g. dp=2,tp=2 (an IR file may declare its own)")
    p.add_argument("--plan", help="preset such as fsdp+tp, or auto; None: the one the mesh's axis names imply")
    p.add_argument("--moe", metavar="SPEC", help="expert mapping for the routed experts, e.g. ep=4 or ep=2,etp=1")
    p.add_argument("--cluster", help="cluster the plan is made for, e.g. h100:8x1; None: gloo ranks on this CPU")
    p.add_argument("--memory", help="per-device memory bound for the sharding solve, e.g. 40GiB; None: the cluster's")
    p.add_argument("--backend", default="eager", help="backend the program is lowered for")
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
    p.add_argument("--no-color", action="store_true", help="plain output without colour")
    return p


def _load_ir_file(path: Path) -> ir.Graph:
    try:
        return ir.parse(path.read_text(encoding="utf-8"))
    except ir.ParseError as e:
        raise CliError(f"{path}: cannot parse IR: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"{path}: cannot read IR text ({e}); pass a file written by the IR printer") from None


Source = tuple[ir.Graph | Any, tuple[Any, ...] | None]
"""An IR graph (no inputs), or a model and its example inputs."""


def _load_factory(spec: str) -> Source:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise CliError(f"model {spec!r} must look like module:factory, e.g. my_models:make_mlp")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        importlib.invalidate_caches()
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        # NOTE: any failure while importing the user's module (syntax error, missing dependency) is a user error.
        raise CliError(
            f"cannot import module {module_name!r} for {spec!r} ({type(e).__name__}: {e}); "
            f"run pass-debug from the directory that contains it"
        ) from None
    finally:
        if added:
            sys.path.remove(cwd)
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise CliError(f"module {module_name!r} has no attribute {attr_path!r}; check the factory name in {spec!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CliError(f"{spec!r} is not callable; it must name a function returning (model, example_inputs)")
    try:
        result = obj()
    except Exception as e:
        # NOTE: the user's factory failed; report it in one line like every other user error.
        raise CliError(f"factory {spec!r} raised {type(e).__name__}: {e}") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], (tuple, list))):
        raise CliError(f"factory {spec!r} returned {type(result).__name__}; it must return (model, example_inputs)")
    return result[0], tuple(result[1])


def _load_zoo(name: str) -> Source:
    try:
        zoo = importlib.import_module("meshfold.tools.zoo")
    except ModuleNotFoundError as e:
        if e.name not in ("meshfold.tools.zoo", "compiler"):
            raise
        raise CliError(f"model {name!r} is not a file or module:factory, and the model zoo is not available") from None
    if name not in zoo.zoo_names():
        raise CliError(
            f"unknown model {name!r}: not an existing file, not module:factory, and not a zoo model "
            f"(zoo models: {', '.join(zoo.zoo_names())})"
        )
    try:
        model, inputs = zoo.build(name)
    except ImportError as e:
        raise CliError(f"zoo model {name!r} needs a missing package ({e}); for hf-* install meshfold[hf]") from None
    return model, tuple(inputs)


def load_model(spec: str) -> tuple[Source, str]:
    """Resolve MODEL (IR file, ``module:factory`` or zoo name) to what ``compile_model`` takes and a
    one-line description."""
    path = Path(spec)
    if path.is_file():
        return (_load_ir_file(path), None), f"IR file {spec}"
    if path.suffix in _IR_SUFFIXES:
        raise CliError(f"IR file {spec!r} does not exist")
    if ":" in spec:
        return _load_factory(spec), f"factory {spec}"
    return _load_zoo(spec), f"zoo model {spec}"


def _parse_mesh(text: str | None) -> ir.Mesh | None:
    if text is None:
        return None
    try:
        return ir.Mesh.parse(text)
    except ValueError as e:
        raise CliError(f"--mesh {text!r} is malformed: {e}") from None


def parse_moe(text: str) -> MoeSpec:
    """``ep=4,etp=1`` (any ``MoeSpec`` field as ``key=value``) as a ``MoeSpec``."""
    try:
        return MoeSpec.of(moe_items(text))
    except TypeError as e:
        raise CliError(f"--moe {text!r}: {e}") from None


def moe_items(text: str) -> dict[str, object]:
    """``ep=4,etp=1`` as ``{"ep": 4, "etp": 1}``: the ``moe=`` mapping exactly as written."""
    spec: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip() or not raw.strip():
            raise CliError(f"--moe {text!r}: write key=value pairs, e.g. ep=4,etp=1")
        spec[key.strip()] = _moe_value(raw.strip())
    if not spec:
        raise CliError(f"--moe {text!r} is empty; e.g. ep=4")
    return spec


def _moe_value(raw: str) -> object:
    """An int, float or boolean when ``raw`` spells one, else the string."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def _axes_text(axes: Sequence[str]) -> str:
    return f"({', '.join(axes)})" if len(axes) > 1 else "".join(axes)


def mapping_line(plan: Plan, mesh: ir.Mesh, spec: MoeSpec | None) -> str:
    """One line naming both mappings, e.g. ``attention: fsdp over dp, tp over tp; experts: EP=4 over
    (dp, tp), EDP=1``; without ``spec`` the experts follow the plan like every other weight."""
    roles = axis_roles(plan, mesh)
    attention = ", ".join(f"{role} over {axis}" for axis, role in roles.items())
    if spec is None:
        return f"attention: {attention}; experts: as attention (no expert mapping)"
    etp, ep, edp = spec.axes(mesh)
    edp_size = mesh.world_size // (spec.ep * spec.etp)
    parts = [f"EP={spec.ep}" + (f" over {_axes_text(ep)}" if ep else "")]
    parts.append(f"EDP={edp_size}" + (f" over {_axes_text(edp)}" if edp else ""))
    if etp:
        parts.append(f"ETP={spec.etp} over {_axes_text(etp)}")
    return f"attention: {attention}; experts: {', '.join(parts)}"


def _experts_role(axis: str, spec: MoeSpec | None, mesh: ir.Mesh) -> str:
    if spec is None:
        return "as attention"
    etp, ep, _ = spec.axes(mesh)
    return "ETP" if axis in etp else "EP" if axis in ep else "EDP"


def moe_tables(graph: ir.Graph, plan: Plan | None, mesh: ir.Mesh | None, spec: MoeSpec | None) -> list[Table]:
    """The mapping of every mesh axis (attention's role, the experts' role) and the layout each
    experts op computes its expert weights with; empty when ``graph`` has no experts op."""
    ops = [op for op in graph.ops if op.target in (EXPERTS, EXPERTS_BACKWARD)]
    if not ops:
        return []
    tables: list[Table] = []
    if mesh is not None and plan is not None:
        roles = axis_roles(plan, mesh)
        mapping = Table(title="MoE mapping", caption=mapping_line(plan, mesh, spec))
        for column in ("mesh axis", "size", "attention", "experts"):
            mapping.add_column(column, justify="right" if column == "size" else "left")
        for axis in mesh.names:
            mapping.add_row(axis, str(mesh.size(axis)), roles[axis], _experts_role(axis, spec, mesh))
        tables.append(mapping)
    experts = Table(title=f"experts ops ({len(ops)}): the layouts they compute with")
    for column in ("module", "phase", "tokens", "expert weights"):
        experts.add_column(column)
    at = {EXPERTS: 0, EXPERTS_BACKWARD: 1}
    for op in ops:
        hidden, gate_up, down = (op.operands[at[op.target] + k] for k in (0, 3, 4))
        weights = {_layout_text(gate_up), _layout_text(down)}
        experts.add_row(op.prov.module, op.prov.phase, _layout_text(hidden), " / ".join(sorted(weights)))
    tables.append(experts)
    return tables


def _layout_text(value: ir.Value) -> str:
    text = str(value.layout)
    return text if text != "{}" else "replicated"


def _verify(graph: ir.Graph, where: str) -> None:
    try:
        ir.verify(graph)
    except ir.VerifyError as e:
        raise CliError(f"verification failed {where}: {e}") from None


def _print_ir(header: str, graph: ir.Graph) -> None:
    print(f"// ----- {header} -----")
    print(str(graph), end="", flush=True)


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


def options_from(args: argparse.Namespace, graph_mesh: ir.Mesh | None) -> CompileOptions:
    """The ``CompileOptions`` the flags spell (``--mesh`` defaults to the mesh an IR file declares)."""
    mesh = _parse_mesh(args.mesh)
    if mesh is not None and graph_mesh is not None and mesh != graph_mesh:
        raise CliError(f"--mesh {mesh} differs from the {graph_mesh} the IR file declares; drop --mesh or match it")
    return CompileOptions.of(
        mesh=mesh if mesh is not None else graph_mesh,
        plan=args.plan,
        moe=moe_items(args.moe) if args.moe is not None else None,
        cluster=args.cluster,
        memory=args.memory,
        pipeline=args.pipeline,
        backend=args.backend,
    )


def _run(args: argparse.Namespace, out: Console, err: Console) -> int:
    assume = frozenset(filter(None, (a.strip() for a in args.assume.split(","))))
    pipeline = PassPipeline.parse(args.pipeline)
    names = [p.name for p in pipeline.passes]
    for name in args.print_after:
        if name not in names:
            raise CliError(f"--print-after {name}: pipeline {pipeline} has no pass named {name!r}")
    if args.dump_dir is not None and args.dump_dir.exists() and not args.dump_dir.is_dir():
        raise CliError(f"--dump-dir {args.dump_dir} exists and is not a directory; pass a directory path")
    if args.mesh is not None:
        _parse_mesh(args.mesh)
    if args.moe is not None:
        parse_moe(args.moe)  # NOTE: a malformed spec is refused before the model is loaded
    (source, inputs), label = load_model(args.model)
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
                source, inputs, options, callback=after_pass, before=before, assume=assume, status=progress()
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
    if args.time_passes:
        err.print(_timing_table(result.timings, result.pipeline.passes))
    if not printing:
        mesh = result.options.mesh or (source.mesh if isinstance(source, ir.Graph) else None)
        title = f"{label}: graph @{first[0].name}, {mesh or 'no mesh'}, pipeline {result.pipeline}"
        out.print(_summary(title, steps))
        plan = result.options.effective_plan() if "sharding" in names else None
        for table in moe_tables(result.graph, plan, mesh, result.options.moe):
            out.print(table)
        if writer is not None:
            out.print(f"dumps: {len(writer.records)} steps in {args.dump_dir}; open {args.dump_dir / 'index.html'}")
    return 0


def show_progress() -> None:
    """Off a terminal, the ``meshfold`` log's progress lines (a stage that took a second or more)
    go to stderr; on one, stages show as a spinner instead (``meshfold.session.progress``)."""
    logger = logging.getLogger("meshfold")
    if not sys.stderr.isatty() and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("meshfold: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


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
