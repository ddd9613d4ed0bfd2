"""How far a plan's peak lies above what the solve's memory row counts, and a solve run on trial.

The row (``AxisProgram._memory``) counts what a rank holds across the forward-backward boundary:
the parameter state (parameter, gradient, two Adam moments) and the activations the backward
reads. The peak (``passes.cost.liveness``, the liveness of the per-rank program) also holds the
backward's working set: a layer's temporaries, the logits' gradient, collectives' staging
buffers. Under a memory bound the sharding pass measures that difference on its first plan and,
where it matters, solves again against the bound less it (exact feedback from the estimate the
memory pass and the verifier use).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from meshfold.ir import Graph, Mesh
from meshfold.ir.graph import local_nbytes
from meshfold.passes.cost.liveness import rank_memory
from meshfold.passes.sharding.ilp.program import STATE_COPIES
from meshfold.target.hardware import Cluster

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

WORKING_SLACK = 0.02
"""A working set at most this share of the bound is left to the memory pass: no second solve."""

T = TypeVar("T")


def working_set(graph: Graph, cluster: Cluster | None) -> int:
    """Bytes per rank by which the predicted peak of ``graph`` (laid out, per rank) exceeds what the
    solve's memory row counts for it."""
    assert graph.mesh is not None
    fwd = {r for op in graph.ops if op.prov.phase == "fwd" for r in op.results}
    saved = {u for op in graph.ops if op.prov.phase == "bwd" for u in op.operands if u in fwd}
    params = sum(local_nbytes(i.value, graph.mesh) for i in graph.inputs if i.kind in ("param", "buffer"))
    counted = STATE_COPIES * params + sum(local_nbytes(v, graph.mesh) for v in saved)
    return rank_memory(graph, cluster=cluster).peak - int(counted)


def fitted(ctx: PassContext, bound: int | None, lay_out: Callable[[PassContext, int | None], Graph]) -> Graph:
    """``lay_out(ctx, bound)``: the per-rank graph of layouts solved under a memory row of ``bound``
    bytes; where its peak shows a working set over ``WORKING_SLACK`` of the bound, laid out again
    under the bound less that (reporting only the second run)."""
    if bound is None:
        return lay_out(ctx, None)
    out, trial = on_trial(ctx, lambda c: lay_out(c, bound))
    work = working_set(out, ctx.options.cluster)
    if work <= WORKING_SLACK * bound:
        trial.commit(ctx)
        return out
    return lay_out(ctx, bound - work)


def spill_prices(graph: Graph, mesh: Mesh, cluster: Cluster | None) -> tuple[tuple[float, float], ...]:
    """``passes.memory.budget.spill_prices``: what the memory pass charges per byte it frees."""
    # NOTE: imported here: the memory pass imports the sharding package (boxing)
    from meshfold.passes.memory.budget import spill_prices as prices

    return prices(graph, mesh, cluster)


@dataclass
class Trial:
    """What a run on trial reported: kept back until ``commit`` passes it on."""

    ctx: PassContext
    caught: list[warnings.WarningMessage] = field(default_factory=list)

    def commit(self, ctx: PassContext) -> None:
        ctx.diagnostics.extend(self.ctx.diagnostics)
        ctx.stats.update(self.ctx.stats)
        for w in self.caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def on_trial(ctx: PassContext, run: Callable[[PassContext], T]) -> tuple[T, Trial]:
    """``run`` on a copy of ``ctx`` whose diagnostics, stats and warnings are held back, so that a run
    done again reports once."""
    trial = Trial(replace(ctx, diagnostics=[], stats={}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(trial.ctx)
    trial.caught = list(caught)
    return out, trial
