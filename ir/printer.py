"""Deterministic text form of a graph. :mod:`ir.parser` reads it back exactly.

graph @mlp mesh<dp=2> {
  param %l1.weight : f32[16, 8]
  input %x : f32[8, 8] {dp: S(0)}
  stack %experts.down_proj = [["experts.0.w2.weight"], ["experts.1.w2.weight"]]
  %t = aten.t(%l1.weight) : f32[8, 16]  # l1 fwd @mlp.py:7
  output out(0) = %loss
}
"""

from __future__ import annotations

import json
import re

import sympy
import torch

from meshfold.ir.graph import Arg, Graph, Op, Provenance, Value
from meshfold.ir.ops import target_name
from meshfold.ir.placement import Layout
from meshfold.ir.symbolic import dim_str
from meshfold.ir.types import ScalarType, Type

NAME_RE = re.compile(r"[A-Za-z0-9_.]+")
_BAD_CHARS = re.compile(r"[^A-Za-z0-9_.]")


class Namer:
    """Gives every value a unique, deterministic text name derived from its hint."""

    def __init__(self) -> None:
        self.names: dict[Value, str] = {}
        self._used: set[str] = set()

    def add(self, v: Value) -> str:
        if v in self.names:
            return self.names[v]
        base = _BAD_CHARS.sub("_", v.name) or "v"
        name, k = base, 0
        while name in self._used:
            k += 1
            name = f"{base}_{k}"
        self._used.add(name)
        self.names[v] = name
        return name

    def __getitem__(self, v: Value) -> str:
        try:
            return self.names[v]
        except KeyError:
            raise ValueError(f"value %{v.name} is used before it is defined") from None


def fmt_type(t: Type, layout: Layout) -> str:
    """``f32[4, 8]`` plus `` {tp: S(1)}`` when the layout is not all-Replicate."""
    s = str(t)
    if isinstance(t, ScalarType) or layout.is_replicated():
        return s
    return f"{s} {layout}"


def fmt_arg(a: Arg, names: Namer) -> str:
    """Text of one argument (values by name, literals in a parseable spelling)."""
    if isinstance(a, Value):
        return "%" + names[a]
    if isinstance(a, tuple):
        return "[" + ", ".join(fmt_arg(x, names) for x in a) + "]"
    if a is None or isinstance(a, bool):
        return str(a)
    if isinstance(a, int):
        return str(a)
    if isinstance(a, float):
        return repr(a)
    if isinstance(a, str):
        return json.dumps(a)
    if isinstance(a, sympy.Expr):
        return f"sym({dim_str(a)})"
    if isinstance(a, torch.device):
        return f"device({json.dumps(str(a))})"
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    raise TypeError(f"cannot print argument {a!r} of type {type(a).__name__}")


def fmt_prov(p: Provenance) -> str:
    text = f"# {p.module or '<root>'} {p.phase}"
    return f"{text} @{p.source}" if p.source else text


def fmt_op(op: Op, names: Namer) -> str:
    """One op line (without indentation); defines names for the op's results."""
    args = [fmt_arg(a, names) for a in op.args] + [f"{k}={fmt_arg(v, names)}" for k, v in op.kwargs]
    call = f"{target_name(op.target)}({', '.join(args)})"
    if op.results:
        lhs = ", ".join("%" + names.add(r) for r in op.results)
        types = ", ".join(fmt_type(r.type, r.layout) for r in op.results)
        call = f"{lhs} = {call} : {types}"
    return f"{call}  {fmt_prov(op.prov)}"


def print_graph(g: Graph) -> str:
    """The whole graph as text; equal graphs print byte-identical text."""
    names = Namer()
    head = f"graph @{g.name}" + (f" {g.mesh}" if g.mesh is not None else "") + " {"
    lines = [head]
    for i in g.inputs:
        lines.append(f"  {i.kind} %{names.add(i.value)} : {fmt_type(i.value.type, i.value.layout)}")
    for st in g.stacks:
        lines.append(f"  stack %{st.name} = {json.dumps([list(row) for row in st.members])}")
    for op in g.ops:
        lines.append("  " + fmt_op(op, names))
    for o in g.outputs:
        lines.append(f"  output {o.kind}({o.name}) = %{names[o.value]}")
    lines.append("}")
    return "\n".join(lines) + "\n"
