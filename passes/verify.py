"""``verify``: run the IR verifier as a pipeline step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from meshfold.ir import Graph, verify
from meshfold.ir.ops import REDISTRIBUTE
from meshfold.ir.verifier import key_classes
from meshfold.passes.base import VERIFIED, Pass, PassError
from meshfold.passes.cost.liveness import rank_memory, size_text
from meshfold.passes.sharding.check import check_layouts

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext


@dataclass(frozen=True)
class Verify(Pass):
    """Check SSA, layouts, started collectives and their waits (the ``overlap`` pass checks its own
    bound on bytes in flight: what its ``scheduled`` property promises) and, with ``types``, every
    op's result types; with ``layouts``, that every op's placements on each mesh axis are allowed by
    its sharding rule; under a memory bound (``parallelize(memory=...)``), that one rank's predicted
    peak (``passes.cost.liveness``) of a boxed program stays under it. Returns the graph unchanged."""

    name: ClassVar[str] = "verify"
    ensures: ClassVar[frozenset[str]] = frozenset({VERIFIED})
    invalidates: ClassVar[frozenset[str]] = frozenset()
    types: bool = True
    layouts: bool = True

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        # NOTE: both checks keep their verdicts per op key; the keys are numbered once for both
        classes = key_classes(graph.ops) if self.types or self.layouts else None
        verify(
            graph,
            check_types=self.types,
            classes=classes,
        )
        if self.layouts:
            check_layouts(graph, classes=classes)
        bound = ctx.options.memory
        if bound is not None and graph.mesh is not None and all(op.target != REDISTRIBUTE for op in graph.ops):
            est = rank_memory(graph, cluster=ctx.options.cluster)
            if est.peak > bound:
                raise PassError(
                    f"the predicted peak of one rank, {size_text(est.peak)} (at {est.peak_at}), exceeds the memory "
                    f"bound of {size_text(bound)}; run the memory pass before overlap to recompute activations, "
                    "shard more or raise the bound"
                )
        return graph
