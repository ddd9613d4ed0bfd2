"""The one compile path: options in, a captured and transformed graph out.

``parallelize``, ``pass-debug``, ``meshfold demo``'s dumps and the golden tests all call
``compile_model``; nothing else parses and runs a pipeline for a model. What it compiles for is an
``Options`` (``meshfold.passes.options``), read and checked once by ``Options.of`` before anything
is captured, and carried to every pass by the ``PassContext``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import nn

from meshfold import ir
from meshfold.backends.select import backend_names
from meshfold.ir.symbolic import size_hints
from meshfold.passes import JOINT, PassContext, PassError, PassPipeline, PassTiming
from meshfold.passes.options import Options
from meshfold.passes.pipeline import Callback
from meshfold.pp.stage_plan import PipelinePlan, plan_pipeline
from meshfold.pp.stage_split import marked_layers
from meshfold.rewrites.capture_passes import AfterCapturePass, capture_pipeline
from meshfold.tracing.tracer import capture

log = logging.getLogger("meshfold")


@dataclass(frozen=True)
class CompileResult:
    """The captured graph, the graph after the pipeline, and what the passes reported."""

    captured: ir.Graph
    graph: ir.Graph
    pipeline: PassPipeline
    options: Options
    timings: tuple[PassTiming, ...]
    diagnostics: tuple[str, ...]
    stats: Mapping[str, object] = field(default_factory=dict)
    guards: tuple[sympy.Basic, ...] = ()
    """With ``dynamic``: the conditions on the symbolic sizes under which the graph is the model's."""
    staged: PipelinePlan | None = None
    """With ``pp``: the schedule and the split of the layers into stages (``plan_pipeline``), made
    once here for every rank."""


def compile_model(
    source: nn.Module | ir.Graph,
    example_inputs: Sequence[Any] | None = None,
    options: Options | str | None = None,
    *,
    callback: Callback | None = None,
    before: Callable[[ir.Graph], None] | None = None,
    assume: frozenset[str] = frozenset(),
    status: Callable[[str], AbstractContextManager[object]] | None = None,
    after_capture: AfterCapturePass | None = None,
) -> CompileResult:
    """Capture ``source`` (a model called on ``example_inputs``) or take it as it is (an IR graph),
    then run the options' pipeline, calling ``before(graph)`` on the pipeline's input and
    ``callback(index, pass, graph_after)`` after each pass.

    ``options`` may be a pipeline string (no mesh). ``assume``: graph properties taken as holding for
    an IR graph (``sharded`` for a graph that already carries layouts). ``status`` shows each long
    stage (default: ``progress()``); ``after_capture(index, pass, text)`` is called after each capture
    pass (``rewrites.capture_passes``) with the fx graph it left. The pipeline is checked before the
    capture starts.
    """
    opts = options if isinstance(options, Options) else Options.of(pipeline=options)
    check_backend(opts.backend)
    capture_pipeline(opts.capture)  # NOTE: an unknown capture pass is refused before anything is traced
    passes = opts.check(assume)
    guards: list[sympy.Basic] = []
    hints: dict[str, int] = {}
    ctx = PassContext(opts, status=status if status is not None else progress())
    if isinstance(source, ir.Graph):
        if opts.mesh is not None and source.mesh is not None and opts.mesh != source.mesh:
            raise PassError(f"the mesh {opts.mesh} differs from the {source.mesh} the graph declares; match it")
        if opts.mesh is None and source.mesh is not None:
            ctx.mesh = source.mesh
        captured = source
    else:
        if example_inputs is None:
            raise PassError("compiling a model needs its example inputs")
        marks = marked_layers(source) if opts.pp is not None else contextlib.nullcontext()
        with ctx.status(f"capturing {type(source).__name__}"), marks:
            # NOTE: moe-fold applies the expert mapping
            captured = capture(
                source,
                tuple(example_inputs),
                dynamic=opts.dynamic,
                guards=guards,
                passes=opts.capture,
                after_pass=after_capture,
                precision=opts.precision,
            )
        hints = _hints(captured, example_inputs, opts.dynamic)
    if not opts.grad:
        captured = forward_only(captured)
    if before is not None:
        before(captured)
    with size_hints(hints):
        graph, timings = passes.run(ctx, captured, callback, initial=assume | {JOINT})
        staged = plan_pipeline(graph, opts.pp, opts.cluster, opts.memory) if opts.pp is not None and opts.grad else None
    return CompileResult(
        captured, graph, passes, opts, tuple(timings), tuple(ctx.diagnostics), dict(ctx.stats), tuple(guards), staged
    )


def check_backend(name: str) -> None:
    """Raise ``PassError`` unless ``name`` is a registered backend a training program runs on
    (``backends.select``; onnx is export only: ``pm.export_onnx``)."""
    trains = backend_names(training_only=True)
    if name not in trains:
        raise PassError(f"backend {name!r} is not available; backends: {', '.join(trains)}")


def _hints(graph: ir.Graph, inputs: Sequence[Any], dynamic: Sequence[tuple[int, int]]) -> dict[str, int]:
    """Each symbolic size's value in the example inputs: what the passes price it at."""
    user = [i.value.type for i in graph.inputs if i.kind == "input"]
    hints: dict[str, int] = {}
    for k, d in dynamic:
        x = inputs[k]
        # NOTE: graph inputs are the tensor arguments, in order
        t = user[sum(isinstance(y, torch.Tensor) for y in inputs[:k])] if isinstance(x, torch.Tensor) else None
        if isinstance(t, ir.TensorType) and d < t.rank and isinstance(t.shape[d], sympy.Symbol):
            hints[str(t.shape[d])] = int(x.shape[d])
    return hints


def forward_only(graph: ir.Graph) -> ir.Graph:
    """``graph`` without its backward: no tangent inputs, no gradient outputs, no backward ops (the
    cleanup pass then drops forward ops only the backward needed)."""
    return dataclasses.replace(
        graph,
        inputs=tuple(i for i in graph.inputs if i.kind != "tangent"),
        ops=tuple(op for op in graph.ops if op.prov.phase == "fwd"),
        outputs=tuple(o for o in graph.outputs if o.kind != "grad"),
    )


def progress() -> Callable[[str], AbstractContextManager[object]]:
    """How a long stage shows what it is doing: a spinner on a terminal (``rich``), else lines in the
    ``meshfold`` log: one at DEBUG when it starts, one at INFO with its time when it took a second
    or more. ``MESHFOLD_PROGRESS=log`` asks for the log lines on a terminal too (a program that shows
    its own spinner, such as ``meshfold demo``, sets it for its ranks)."""
    spinner = sys.stderr.isatty() and os.environ.get("MESHFOLD_PROGRESS", "") != "log"
    return _Spinner() if spinner else _logged


class _Spinner:
    """One ``rich`` status line for nested stages (rich allows one live display at a time): an inner
    stage's message is shown after its outer one's."""

    def __init__(self) -> None:
        from rich.console import Console

        self._console = Console(stderr=True)
        self._live: Any = None
        self._stack: list[str] = []

    @contextlib.contextmanager
    def __call__(self, message: str) -> Iterator[None]:
        if self._live is None:
            with self._console.status(message) as live:
                self._live, self._stack = live, [message]
                try:
                    yield
                finally:
                    self._live = None
            return
        self._stack.append(message)
        self._live.update(" · ".join(self._stack))
        try:
            yield
        finally:
            self._stack.pop()
            self._live.update(" · ".join(self._stack))


@contextlib.contextmanager
def _logged(message: str) -> Iterator[None]:
    log.debug("%s ...", message)
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    if seconds >= 1.0:
        log.info("%s: done in %.1f s", message, seconds)
