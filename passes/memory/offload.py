"""Offload: forward values the backward reads, moved to the host tier and back.

``offloaded(graph, values)`` writes each value to the host tier (``mem.offload``) right after its
last forward reader (after its producer when the forward reads it no more) and reads it back
(``mem.reload``) right before its first backward reader, which reads the copy; the forward hands
the backward the host copy instead of the value, so the value is freed in the forward. The eager
backend lowers the pair to a file-backed copy on CPU ranks (``backends/host_tier.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

from meshfold.ir import Graph, GraphBuilder, Op, TensorType, Value
from meshfold.ir.graph import Provenance, fresh_name, local_nbytes, map_values
from meshfold.ir.ops import OFFLOAD, RELOAD

MIN_BYTES = 4096
"""Smaller values stay: a file per tensor costs more than it frees."""


def saved_activations(graph: Graph, min_bytes: int = MIN_BYTES) -> list[Value]:
    """The forward results the backward reads (not the graph's outputs), of ``min_bytes`` or more on
    a rank, in program order."""
    made = {r for op in graph.ops if op.prov.phase == "fwd" for r in op.results}
    outputs = {o.value for o in graph.outputs}
    read = [u for op in graph.ops if op.prov.phase == "bwd" for u in op.operands]
    keep = [v for v in dict.fromkeys(read) if v in made and v not in outputs and isinstance(v.type, TensorType)]
    return [v for v in keep if local_nbytes(v, graph.mesh) >= min_bytes]


def offloaded(graph: Graph, values: Collection[Value]) -> Graph:
    """``graph`` with ``values`` offloaded after their last forward reader and reloaded before their
    first backward reader (see the module doc)."""
    producer = {r: op for op in graph.ops for r in op.results}
    last: dict[Value, int] = {}
    for k, op in enumerate(graph.ops):
        for v in (*op.results, *(op.operands if op.prov.phase == "fwd" else ())):
            if v in values:
                last[v] = k
    after: dict[int, list[Value]] = defaultdict(list)
    for v in values:
        after[last[v]].append(v)
    names = {i.value.name for i in graph.inputs} | {r.name for op in graph.ops for r in op.results}
    b = GraphBuilder.like(graph)
    handle: dict[Value, Value] = {}
    back: dict[Value, Value] = {}

    for k, op in enumerate(graph.ops):
        if op.prov.phase == "bwd":
            for u in op.operands:
                if u in handle and u not in back:
                    back[u] = Value(fresh_name(f"{u.name}_reloaded", names), u.type, u.layout)
                    prov = Provenance(producer[u].prov.module, "bwd", producer[u].prov.source)
                    b.append(Op(RELOAD, (handle[u],), (), (back[u],), prov))
            args = tuple(map_values(a, back) for a in op.args)
            kwargs = tuple((key, map_values(a, back)) for key, a in op.kwargs)
            op = op if args == op.args and kwargs == op.kwargs else Op(op.target, args, kwargs, op.results, op.prov)
        b.append(op)
        for v in after.get(k, ()):
            handle[v] = Value(fresh_name(f"{v.name}_host", names), v.type, v.layout)
            prov = Provenance(producer[v].prov.module, "fwd", producer[v].prov.source)
            b.append(Op(OFFLOAD, (v,), (), (handle[v],), prov))
    for o in graph.outputs:
        b.add_output(o.kind, o.name, o.value)
    return b.build()
