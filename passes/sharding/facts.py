"""What every axis program of one graph reads from the graph alone, found once per graph.

The sharding solve builds four programs of one graph (``auto``'s two mesh axes and the preset's it
is priced against); each walked every op for the same facts (where a value comes from, which ops
make only scalars, which activations the backward keeps). At 80 layers a walk is about 18k ops.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from meshfold.ir import Graph, TensorType, Value
from meshfold.ir.memo import Kept
from meshfold.ir.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.passes.sharding.batch import batch_values


@dataclass(frozen=True)
class GraphFacts:
    """``source``: each op result's (op index, result index); ``scalar_only``: per op, whether a
    batch value may be read whole by it (every result a scalar, or the experts op, whose
    all-gather dispatcher gathers the tokens by design); ``reads``: per op, its tensor operands as
    (operand index, value); ``saved``: forward results the backward reads, then the parameters and
    buffers, in program order without repeats; ``params``: the parameters and buffers;
    ``batch``: ``batch_values`` of the graph."""

    source: dict[Value, tuple[int, int]]
    scalar_only: list[bool]
    reads: list[list[tuple[int, Value]]]
    saved: list[Value]
    params: frozenset[Value]
    batch: frozenset[Value]


_KEPT: Kept[Graph, GraphFacts] = {}
_LOCK = threading.Lock()


def graph_facts(graph: Graph) -> GraphFacts:
    """``graph``'s facts, kept for the last graph asked (the programs of one solve ask in turn)."""
    with _LOCK:
        hit = _KEPT.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    facts = _facts(graph)
    with _LOCK:
        _KEPT.clear()  # NOTE: one graph at a time: a compile's programs come one after another
        _KEPT[id(graph)] = (graph, facts)
    return facts


def _facts(graph: Graph) -> GraphFacts:
    source: dict[Value, tuple[int, int]] = {}
    scalar_only: list[bool] = []
    reads: list[list[tuple[int, Value]]] = []
    fwd: set[Value] = set()
    saved: dict[Value, None] = {}
    for op_i, op in enumerate(graph.ops):
        for j, r in enumerate(op.results):
            source[r] = (op_i, j)
        scalar_only.append(
            op.target in (EXPERTS, EXPERTS_BACKWARD)
            or all(isinstance(r.type, TensorType) and r.type.rank == 0 for r in op.results)
        )
        reads.append([(k, v) for k, v in enumerate(op.operands) if isinstance(v.type, TensorType)])
        if op.prov.phase == "fwd":
            fwd.update(op.results)
    for op in graph.ops:
        if op.prov.phase == "bwd":
            saved.update((v, None) for v in op.operands if v in fwd)
    params = [i.value for i in graph.inputs if i.kind in ("param", "buffer")]
    saved.update((v, None) for v in params)
    return GraphFacts(source, scalar_only, reads, list(saved), frozenset(params), batch_values(graph))
