"""What the ``meshfold`` and ``pass-debug`` commands share: loading a model from what a user names,
reading ``--mesh`` and ``--moe``, the MoE mapping tables, user errors and progress lines.

One loader for every command that takes a model (``pass-debug MODEL``, ``meshfold plan --model``,
``meshfold demo --model``): a zoo name, ``module:factory`` imported from the current directory (a
callable returning ``(model, example_inputs)``), or, for pass-debug, an IR text file. It imports
torch, so ``meshfold plan`` imports it only when a model needs building.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table
from torch import nn

from meshfold import ir
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.passes.base import PassError
from meshfold.passes.moe.spec import MoeSpec
from meshfold.passes.options import key_values
from meshfold.passes.sharding.plans import Plan, axis_roles

_IR_SUFFIXES = (".mlir", ".ir", ".txt")

Source = tuple[ir.Graph | Any, tuple[Any, ...] | None]
"""An IR graph (no inputs), or a model and its example inputs."""


class CliError(ValueError):
    """A user error: shown as one line on stderr, exit code 2."""


def _load_ir_file(path: Path) -> ir.Graph:
    try:
        return ir.parse(path.read_text(encoding="utf-8"), file=str(path))
    except ir.ParseError as e:
        raise CliError(f"cannot parse IR: {e}") from None  # NOTE: ``e`` starts with ``<path>:L:C: ``
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"{path}: cannot read IR text ({e}); pass a file written by the IR printer") from None


Source = tuple[ir.Graph | Any, tuple[Any, ...] | None]
"""An IR graph (no inputs), or a model and its example inputs."""


def call_factory(spec: str, command: str = "meshfold") -> Any:
    """Import ``module`` (from the current directory first) and return what ``module:factory`` returns
    when called with no arguments. ``factory`` may be a dotted path (``models:Zoo.make``)."""
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
            f"run {command} from the directory that contains it"
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
        return obj()
    except Exception as e:
        # NOTE: the user's factory failed; report it in one line like every other user error.
        raise CliError(f"factory {spec!r} raised {type(e).__name__}: {e}") from None


def is_model_and_inputs(result: Any) -> bool:
    """Whether a factory's result keeps the contract: ``(model, example_inputs)``."""
    return (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and isinstance(result[0], nn.Module)
        and isinstance(result[1], (tuple, list))
    )


def load_factory(spec: str, command: str = "meshfold") -> tuple[nn.Module, tuple[Any, ...]]:
    """``(model, example_inputs)`` from ``module:factory`` (see :func:`call_factory`)."""
    result = call_factory(spec, command)
    if not is_model_and_inputs(result):
        raise CliError(f"factory {spec!r} returned {type(result).__name__}; it must return (model, example_inputs)")
    return result[0], tuple(result[1])


def load_zoo(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """``(model, example_inputs)`` of zoo model ``name``; CliError lists the zoo when it has no such model."""
    from meshfold.tools import zoo

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


def load_source(spec: str) -> tuple[Source, str]:
    """Resolve MODEL (IR file, ``module:factory`` or zoo name) to what ``compile_model`` takes and a
    one-line description."""
    path = Path(spec)
    if path.is_file():
        return (_load_ir_file(path), None), f"IR file {spec}"
    if path.suffix in _IR_SUFFIXES:
        raise CliError(f"IR file {spec!r} does not exist")
    if ":" in spec:
        return load_factory(spec, "pass-debug"), f"factory {spec}"
    return load_zoo(spec), f"zoo model {spec}"


def parse_mesh(text: str | None) -> ir.Mesh | None:
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


def moe_items(text: str, flag: str = "--moe", example: str = "ep=4,etp=1") -> dict[str, object]:
    """``ep=4,etp=1`` as ``{"ep": 4, "etp": 1}``: the ``moe=`` mapping (or another option's, named
    ``flag``) exactly as written (``passes.options.key_values``)."""
    try:
        return key_values(text, flag, example)
    except PassError as e:
        raise CliError(str(e)) from None


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


def show_progress() -> None:
    """Off a terminal, the ``meshfold`` log's progress lines (a stage that took a second or more)
    go to stderr; on one, stages show as a spinner instead (``meshfold.session.progress``)."""
    logger = logging.getLogger("meshfold")
    if not sys.stderr.isatty() and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("meshfold: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
