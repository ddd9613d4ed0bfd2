"""Recompute in the backward: forward values the backward reads, made again where it reads them.

``recompute(graph, chosen)`` leaves the forward as it is and, before each backward op, inserts a copy
of the forward ops that produce the ``chosen`` values it reads (and, transitively, the chosen values
those ops read), with fresh results; the backward reads the copies. A chosen value is then no
longer handed from the forward to the backward (``backends.eager.lower`` saves what the backward
reads), so it lives only until its last forward use; what the copies read and is not chosen
becomes saved instead (a block's input, a parameter). The copies run the same kernels on the same
operands, so the backward sees the same numbers.

Only ops whose repetition changes nothing can be chosen (``recomputable``): no mutation and no draw
from a generator (a dropout mask is kept, never drawn twice).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from meshfold.ir import Graph, GraphBuilder, Op, OpDef, Value, is_pure
from meshfold.ir.graph import Provenance, fresh_name, map_values
from meshfold.ir.ops import draws
from meshfold.passes.cleanup import computation_key


def recomputable(op: Op, overwritten: Collection[Value] = frozenset()) -> bool:
    """Whether running ``op`` again in the backward gives what the forward's run gave: a forward op
    that mutates nothing, draws nothing (attention without dropout is tagged as seeded but draws
    nothing) and reads no buffer the step ``overwritten`` (``overwritten_buffers``: in the backward
    it would read the new value; BatchNorm reads the running statistics it updates)."""
    if op.prov.phase != "fwd" or draws(op) or any(v in overwritten for v in op.operands):
        return False
    return op.target.pure if isinstance(op.target, OpDef) else not op.target._schema.is_mutable


def overwritten_buffers(graph: Graph) -> frozenset[Value]:
    """The buffers (graph inputs) a step of ``graph`` updates in place (an ``update`` output names them)."""
    updated = {o.name for o in graph.outputs if o.kind == "update"}
    return frozenset(i.value for i in graph.inputs if i.kind == "buffer" and i.name in updated)


def recompute(graph: Graph, chosen: Collection[Value]) -> Graph:
    """``graph`` with every chosen forward value the backward reads recomputed before its first
    backward reader (see the module doc). Raises ``ValueError`` for a value no recomputable forward
    op produces, or one the graph outputs."""
    made = {r: op for op in graph.ops if op.prov.phase == "fwd" for r in op.results}
    outputs = {o.value for o in graph.outputs}
    overwritten = overwritten_buffers(graph)
    for v in chosen:
        op = made.get(v)
        if op is None or not recomputable(op, overwritten) or v in outputs:
            raise ValueError(f"%{v.name} cannot be recomputed: only a pure forward op's non-output result can")
    names = {i.value.name for i in graph.inputs} | {r.name for op in graph.ops for r in op.results}
    copy: dict[Value, Value] = {}
    # NOTE: a backward op the same as a recomputed one (the gather of a parameter the backward makes
    # anyway) reads the recomputed results instead of running again
    made_again: dict[object, tuple[Value, ...]] = {}
    b = GraphBuilder.like(graph)

    def materialise(values: Iterable[Value]) -> None:
        # NOTE: depth-first over the chosen producers, operands before the op (no recursion: a
        # chain through a whole block can be hundreds of ops long)
        todo = [(v, False) for v in values if v in chosen and v not in copy]
        while todo:
            v, expanded = todo.pop()
            if v in copy:
                continue
            op = made[v]
            if not expanded:
                todo.append((v, True))
                todo.extend((u, False) for u in op.operands if u in chosen and u not in copy)
                continue
            results = tuple(Value(fresh_name(f"{r.name}_rc", names), r.type, r.layout) for r in op.results)
            prov = Provenance(op.prov.module, "bwd", op.prov.source)
            args = tuple(map_values(a, copy) for a in op.args)
            kwargs = tuple((k, map_values(a, copy)) for k, a in op.kwargs)
            b.append(Op(op.target, args, kwargs, results, prov))
            made_again[computation_key(op.target, args, kwargs, results)] = results
            copy.update(zip(op.results, results, strict=True))

    for op in graph.ops:
        if op.prov.phase == "fwd":
            b.append(op)
            continue
        materialise(op.operands)
        args = tuple(map_values(a, copy) for a in op.args)
        kwargs = tuple((k, map_values(a, copy)) for k, a in op.kwargs)
        same = made_again.get(computation_key(op.target, args, kwargs, op.results)) if is_pure(op.target) else None
        if same is not None:
            copy.update(zip(op.results, same, strict=True))
            continue
        b.append(op if args == op.args and kwargs == op.kwargs else Op(op.target, args, kwargs, op.results, op.prov))
    for o in graph.outputs:
        # NOTE: the forward's outputs (the loss, a buffer's update) stay the forward's values: a recomputed
        # op's other results (BatchNorm's new running statistics beside its output) are copied too
        b.add_output(o.kind, o.name, copy.get(o.value, o.value) if o.kind == "grad" else o.value)
    return b.build()
