"""``verify``: run the IR verifier as a pipeline step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from meshfold.ir import Graph, verify
from meshfold.passes.base import VERIFIED, Pass, PassContext
from meshfold.passes.schedule.overlap import INFLIGHT_STAT
from meshfold.passes.sharding.check import check_layouts


@dataclass(frozen=True)
class Verify(Pass):
    """Check SSA, layouts, started collectives and their waits (under the ``overlap`` pass's bound on
    bytes in flight when it ran) and (with ``types``) every op's result types; with ``layouts``, that
    every op's placements on each mesh axis are allowed by its sharding rule. Returns the graph
    unchanged."""

    name: ClassVar[str] = "verify"
    ensures: ClassVar[frozenset[str]] = frozenset({VERIFIED})
    invalidates: ClassVar[frozenset[str]] = frozenset()
    types: bool = True
    layouts: bool = True

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        bound = ctx.stats.get(INFLIGHT_STAT)
        verify(graph, check_types=self.types, max_inflight=float(bound) if isinstance(bound, float) else None)
        if self.layouts:
            check_layouts(graph)
        return graph
