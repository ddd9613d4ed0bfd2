"""Symbolic sizes: what passes price them at, and the static graph one call's sizes make of them.

A graph captured with a symbolic dimension (a sequence length ``s0``) is planned once: every pass
sees ``s0`` in shapes and shape arguments. Where a pass needs a number (bytes to move, FLOPs), it
asks :func:`size_hint`, which prices each symbol at its hint (the size it had when captured, set by
:func:`size_hints` around the pipeline; ``DEFAULT_HINT`` for a graph read from text). Each call then
runs :func:`specialize`'s graph: the same ops and layouts with the call's sizes substituted, which
lowers like any static graph.
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy

from meshfold.ir.graph import Arg, Graph, GraphBuilder, GraphOutput, Op, Value
from meshfold.ir.ops import OpDef
from meshfold.ir.symbolic import Dim
from meshfold.ir.types import TensorType, Type
from meshfold.ir.verifier import verify_op_types


def symbols_of(graph: Graph) -> set[sympy.Symbol]:
    """Every symbol in the graph's input shapes."""
    out: set[sympy.Symbol] = set()
    for i in graph.inputs:
        if isinstance(i.value.type, TensorType):
            for d in i.value.type.shape:
                if not isinstance(d, int):
                    out |= d.free_symbols  # type: ignore[arg-type]
    return out


def specialize(graph: Graph, binding: Mapping[str, int]) -> Graph:
    """``graph`` with every symbol replaced by its size in ``binding`` (by symbol name): in types and
    in op arguments. Layouts, names and provenance stay; the result has static shapes. The ops whose
    arguments held a symbolic size (which the verifier could not type-check before) are checked
    now; raises ``VerifyError`` naming the first whose result types differ from what it computes."""
    subs = {sympy.Symbol(name, integer=True, positive=True): value for name, value in binding.items()}

    def dim(d: Dim) -> Dim:
        if isinstance(d, int):
            return d
        v = d.subs(subs)
        if not v.is_Integer:
            raise ValueError(f"size {d} has no value: its symbols {sorted(map(str, v.free_symbols))} are not bound")
        return int(v)

    def of_type(t: Type) -> Type:
        return TensorType(tuple(dim(d) for d in t.shape), t.dtype) if isinstance(t, TensorType) else t

    values: dict[Value, Value] = {}

    def value(v: Value) -> Value:
        if v not in values:
            values[v] = Value(v.name, of_type(v.type), v.layout)
        return values[v]

    def arg(a: Arg) -> Arg:
        if isinstance(a, Value):
            return value(a)
        if isinstance(a, tuple):
            return tuple(arg(x) for x in a)
        if isinstance(a, sympy.Expr):
            return dim(a)
        return a

    b = GraphBuilder(graph.name, graph.mesh)
    b.stacks = graph.stacks
    for i in graph.inputs:
        b._inputs.append(type(i)(i.kind, value(i.value)))
    sized: list[Op] = []
    for op in graph.ops:
        new = Op(
            op.target,
            tuple(arg(a) for a in op.args),
            tuple((k, arg(v)) for k, v in op.kwargs),
            tuple(value(r) for r in op.results),
            op.prov,
        )
        if not isinstance(op.target, OpDef) and _symbolic((op.args, tuple(v for _, v in op.kwargs))):
            sized.append(new)
        b.append(new)
    for o in graph.outputs:
        b._outputs.append(GraphOutput(o.kind, o.name, value(o.value)))
    verify_op_types(sized)
    return b.build()


def _symbolic(a: object) -> bool:
    if isinstance(a, tuple):
        return any(_symbolic(x) for x in a)
    return isinstance(a, sympy.Expr) and not a.is_Integer
