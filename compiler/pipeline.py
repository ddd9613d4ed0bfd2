"""The default pipeline and the one call that captures a model and runs a pipeline over it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from meshfold import ir
from meshfold.passes import Pass, PassContext, PassPipeline, PassTiming, parse_pipeline
from meshfold.passes.pipeline import Callback
from meshfold.tracer import capture

# NOTE: grows with every pass that lands; `meshfold demo`, `pass-debug` and `parallelize` use it.
# Without a mesh, sharding and boxing leave the single-device graph as it is.
DEFAULT_PIPELINE = "cleanup,sharding,boxing,bucket,verify"


@dataclass(frozen=True)
class CompileResult:
    """The captured graph, the graph after the pipeline, and per-pass wall times."""

    captured: ir.Graph
    graph: ir.Graph
    pipeline: PassPipeline
    timings: tuple[PassTiming, ...]
    diagnostics: tuple[str, ...]


def compile_model(
    model: nn.Module,
    example_inputs: Sequence[Any],
    pipeline: str | Sequence[Pass] = DEFAULT_PIPELINE,
    *,
    mesh: ir.Mesh | None = None,
    callback: Callback | None = None,
) -> CompileResult:
    """Capture ``model`` and run ``pipeline`` (checked for order before capture starts)."""
    pipe = parse_pipeline(pipeline)
    pipe.check()
    captured = capture(model, example_inputs)
    ctx = PassContext(mesh=mesh)
    graph, timings = pipe.run(ctx, captured, callback)
    return CompileResult(captured, graph, pipe, tuple(timings), tuple(ctx.diagnostics))
