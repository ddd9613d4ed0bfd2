"""Summaries of a sharded graph: per-parameter layouts and collectives per step with bytes moved."""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.ir import Graph, OpDef, Shard, TensorType
from meshfold.passes.sharding.cost import comm_volume, nbytes


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
        if not isinstance(op.target, OpDef) or op.target.namespace != "comm":
            continue
        axis = str(op.kwarg("axis"))
        sent = 0.0
        for x in op.operands:  # NOTE: a bucket is one collective over all its operands
            if not isinstance(x.type, TensorType):
                continue
            local = nbytes(x.type)
            for ax, p in zip(x.layout.axes, x.layout.placements, strict=True):
                if isinstance(p, Shard):
                    local /= mesh.size(ax)
            sent += comm_volume(op.name, local, mesh.size(axis))
        if not any(isinstance(x.type, TensorType) for x in op.operands):
            continue
        slot = acc.setdefault((op.name, axis, op.prov.phase), [0, 0.0])
        slot[0] += 1
        slot[1] += sent
    return [CommLine(k[0], k[1], k[2], int(v[0]), v[1]) for k, v in acc.items()]
