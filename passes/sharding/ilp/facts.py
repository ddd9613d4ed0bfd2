"""What every axis program of one graph reads from the graph alone, found once per graph.

The sharding solve builds four programs of one graph (``auto``'s two mesh axes and the preset's it
is priced against); each walked every op for the same facts (where a value comes from, which ops
make only scalars, which activations the backward keeps). At 80 layers a walk is about 18k ops.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from meshfold.ir import Graph, TensorType, Value
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.ir.memo import Kept
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
T = TypeVar("T")


def _last(kept: Kept[Graph, T], graph: Graph, make: Callable[[], T], fits: Callable[[T], bool] = lambda _: True) -> T:
    """What ``make`` gives for ``graph``, kept in ``kept`` for the last graph asked (one graph at a
    time: a compile's programs come one after another) while ``fits`` holds of it."""
    with _LOCK:
        hit = kept.get(id(graph))
    if hit is not None and hit[0] is graph and fits(hit[1]):
        return hit[1]
    made = make()
    with _LOCK:
        kept.clear()
        kept[id(graph)] = (graph, made)
    return made


def graph_facts(graph: Graph) -> GraphFacts:
    """``graph``'s facts, kept for the last graph asked (the programs of one solve ask in turn)."""
    return _last(_KEPT, graph, lambda: _facts(graph))


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


@dataclass(frozen=True)
class OpReads:
    """Every value's reads by ops, each under (the op its reader is tied to, operand index, phase),
    the first reader's index kept (consumers tied to one op read through its columns in one way);
    ``mirror``: each op result whose reads have the very keys of the same result of the op its
    producer is tied to (that value). The same for every axis program tying the same ops."""

    tied: dict[int, int]
    by_value: dict[Value, dict[tuple[int, int, str], int]]
    mirror: dict[Value, Value]


_READS: Kept[Graph, OpReads] = {}


def op_reads(graph: Graph, tied: dict[int, int]) -> OpReads:
    """``OpReads`` of ``graph`` under ``tied``, kept for the last graph and ties asked."""
    return _last(_READS, graph, lambda: _op_reads(graph, tied), lambda r: r.tied == tied)


def _op_reads(graph: Graph, tied: dict[int, int]) -> OpReads:
    facts = graph_facts(graph)
    by_value: dict[Value, dict[tuple[int, int, str], int]] = {}
    for op_i, (op, tensors) in enumerate(zip(graph.ops, facts.reads, strict=True)):
        rep = tied.get(op_i, op_i)
        phase = op.prov.phase
        for k, v in tensors:
            seen = by_value.get(v)
            if seen is None:
                seen = by_value[v] = {}
            seen.setdefault((rep, k, phase), op_i)
    mirror: dict[Value, Value] = {}
    for v, mine in by_value.items():
        src = facts.source.get(v)
        if src is None or src[0] not in tied:
            continue
        w = graph.ops[tied[src[0]]].results[src[1]]
        theirs = by_value.get(w)
        if theirs is not None and list(theirs) == list(mine):
            mirror[v] = w
    return OpReads(dict(tied), by_value, mirror)
