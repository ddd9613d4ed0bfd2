"""A joint graph split by phase: what the forward and backward modules of a rank's program run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshfold import ir
from meshfold.ir import Graph, Op, Value
from meshfold.ir.ops import REDISTRIBUTE, WAIT


@dataclass(frozen=True)
class Phases:
    """A joint graph's forward and backward ops, what each takes and returns, and the forward's
    values the backward reads (``saved``, in the order the forward module returns them)."""

    fwd_ops: list[Op]
    bwd_ops: list[Op]
    fwd_inputs: list[ir.GraphInput]
    fwd_out: list[ir.GraphOutput]
    tangents: list[ir.GraphInput]
    grads: list[ir.GraphOutput]
    saved: list[Value]


def phases(graph: Graph) -> Phases:
    """``graph`` split by phase (see ``Phases``); raises on a forward op reading a backward value."""
    if any(op.target == REDISTRIBUTE for op in graph.ops):
        raise ValueError("graph still has comm.redistribute ops; run the boxing pass before lowering")
    fwd_ops = [op for op in graph.ops if op.prov.phase == "fwd"]
    bwd_ops = [op for op in graph.ops if op.prov.phase == "bwd"]
    fwd_defined = {i.value for i in graph.inputs if i.kind != "tangent"} | {r for op in fwd_ops for r in op.results}
    for op in fwd_ops:
        for v in op.operands:
            if v not in fwd_defined:
                raise ValueError(f"{op.describe()}: forward op uses %{v.name}, which only the backward defines")
    grads = [o for o in graph.outputs if o.kind == "grad"]
    tangents = [i for i in graph.inputs if i.kind == "tangent"]
    bwd_defined = {r for op in bwd_ops for r in op.results} | {i.value for i in tangents}
    saved: list[Value] = []
    for v in [*(u for op in bwd_ops for u in op.operands), *(o.value for o in grads)]:
        if v not in bwd_defined and v not in saved:
            saved.append(v)
    fwd_inputs = [i for i in graph.inputs if i.kind != "tangent"]
    fwd_out = [o for o in graph.outputs if o.kind in ("out", "update")]
    return Phases(fwd_ops, bwd_ops, fwd_inputs, fwd_out, tangents, grads, saved)


def recorded_values(ops: Sequence[Op]) -> list[Value]:
    """The values ``ops`` compute (a started collective's handles are its wait's results): what a
    recording program returns for verification (``lower(..., record=True)``)."""
    handles = {v for op in ops if op.target == WAIT for v in op.operands}
    return [r for op in ops for r in op.results if isinstance(r.type, ir.TensorType) and r not in handles]
