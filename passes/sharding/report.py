"""Summaries of a sharded graph: per-parameter layouts and collectives per step with bytes moved."""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.ir import Graph, OpDef, TensorType


@dataclass(frozen=True)
class CommLine:
    """One kind of collective on one mesh axis: how many per step and bytes each rank sends."""

    op: str
    axis: str
    phase: str
    count: int
    bytes_per_rank: float


def comm_summary(graph: Graph) -> list[CommLine]:
    """Collectives of a boxed graph grouped by (op, axis, phase), in first-appearance order."""
    assert graph.mesh is not None, "comm_summary needs a graph with a mesh"
    mesh = graph.mesh
    acc: dict[tuple[str, str, str], list[float]] = {}
    for op in graph.ops:
        target = op.target
        if not isinstance(target, OpDef) or target.namespace != "comm":
            continue
        axis = str(op.kwarg("axis"))
        attrs = dict(op.kwargs)
        # NOTE: a bucket is one collective over all its operands
        sent = sum(
            target.wire_bytes_of(x.type, x.layout, mesh, attrs) for x in op.operands if isinstance(x.type, TensorType)
        )
        if not any(isinstance(x.type, TensorType) for x in op.operands):
            continue
        slot = acc.setdefault((op.name, axis, op.prov.phase), [0, 0.0])
        slot[0] += 1
        slot[1] += sent
    return [CommLine(k[0], k[1], k[2], int(v[0]), v[1]) for k, v in acc.items()]
