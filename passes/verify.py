"""``verify``: run the IR verifier as a pipeline step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ir import Graph, verify
from passes.base import VERIFIED, Pass, PassContext


@dataclass(frozen=True)
class Verify(Pass):
    """Check SSA, layouts and (with ``types``) every op's result types; return the graph unchanged."""

    name: ClassVar[str] = "verify"
    ensures: ClassVar[frozenset[str]] = frozenset({VERIFIED})
    invalidates: ClassVar[frozenset[str]] = frozenset()
    types: bool = True

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        verify(graph, check_types=self.types)
        return graph
