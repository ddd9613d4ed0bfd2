"""``verify``: run the IR verifier as a pipeline step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from meshfold.ir import Graph, verify
from meshfold.passes.base import VERIFIED, Pass, PassContext
from meshfold.passes.sharding.check import check_layouts


@dataclass(frozen=True)
class Verify(Pass):
    """Check SSA, layouts and (with ``types``) every op's result types; with ``layouts``, that every
    op's placements on each mesh axis are allowed by its sharding rule. Returns the graph unchanged."""

    name: ClassVar[str] = "verify"
    ensures: ClassVar[frozenset[str]] = frozenset({VERIFIED})
    invalidates: ClassVar[frozenset[str]] = frozenset()
    types: bool = True
    layouts: bool = True

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        verify(graph, check_types=self.types)
        if self.layouts:
            check_layouts(graph)
        return graph
