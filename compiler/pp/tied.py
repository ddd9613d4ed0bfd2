"""Weights several pipeline stages read (input and output embeddings tied): each stage holds a copy
and returns its part of the gradient (``meshfold.pp.stage_split``); the ranks holding it add the parts after
the step (``meshfold.pp.pipelined``), so the copies stay equal."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from meshfold.ir import Graph, Op, OpDef, Value
from meshfold.ir.graph import fresh_name, map_values
from meshfold.ir.ops import WAIT
from meshfold.passes.base import PassError

_ADD = torch.ops.aten.add.Tensor
_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def tied_parameters(stages: list[Graph]) -> dict[str, tuple[int, ...]]:
    """The parameters several stages read (tied weights), and those stages."""
    readers: dict[str, list[int]] = defaultdict(list)
    for s, g in enumerate(stages):
        for i in g.inputs:
            if i.kind == "param":
                readers[i.name].append(s)
    return {name: tuple(at) for name, at in readers.items() if len(at) > 1}


def tied_parts(
    graph: Graph, where: list[frozenset[int]]
) -> tuple[set[int], dict[tuple[int, str], Value], dict[int, list[Op]]]:
    """For each parameter several stages read, each stage's part of its gradient. The joint graph
    adds the stages' terms (``aten.add``), then maybe reduces the sum over a data-parallel axis (a
    reduce-scatter and its wait, a reshape: ops linear in their one operand); each stage instead
    applies those ops to its own term. Returns the ops no stage runs (the sum and what followed it),
    the part per (stage, parameter), and the ops each stage runs to make its parts."""
    params = {i.value: i.name for i in graph.inputs if i.kind == "param"}
    readers: dict[str, set[int]] = defaultdict(set)
    for op, at in zip(graph.ops, where, strict=True):
        for v in op.operands:
            if v in params:
                readers[params[v]] |= at
    index = {r: i for i, op in enumerate(graph.ops) for r in op.results}
    taken = {r.name for op in graph.ops for r in op.results} | {i.name for i in graph.inputs}
    joins: set[int] = set()
    parts: dict[tuple[int, str], Value] = {}
    extra: dict[int, list[Op]] = defaultdict(list)

    def stage_of(v: Value) -> frozenset[int]:
        return where[index[v]] if v in index else frozenset()

    def refuse(name: str, v: Value) -> PassError:
        return PassError(
            f"parameter {name!r} is read by pipeline stages {sorted(readers[name])} (a weight tied across "
            f"stages), but its gradient is not a sum of one part per stage (at %{v.name}); untie it"
        )

    def walk(name: str, v: Value, after: list[Op]) -> bool:
        """Whether ``v`` (then ``after``) is a sum of the stages' terms; records the parts if so."""
        i = index.get(v)
        if i is None:
            return False
        op = graph.ops[i]
        if (
            op.target == _ADD
            and len(op.operands) == 2
            and not op.kwargs
            and stage_of(op.operands[0]) != stage_of(op.operands[1])
        ):
            joins.add(i)
            joins.update(index[r] for o in after for r in o.results[:1])
            for term in op.operands:
                at = stage_of(term)
                if len(at) != 1 or (min(at), name) in parts:
                    raise refuse(name, term)
                parts[(min(at), name)] = _applied(after, v, term, extra[min(at)], taken)
            return True
        if len(op.operands) == 1 and _linear(op):
            return walk(name, op.operands[0], [op, *after])
        return False

    for o in graph.outputs:
        if o.kind == "grad" and len(readers.get(o.name, ())) > 1 and not walk(o.name, o.value, []):
            raise refuse(o.name, o.value)
    return joins, parts, extra


def _linear(op: Op) -> bool:
    """An op of one operand whose result is linear in it (sums pass through it)."""
    if op.target == WAIT or op.target in _RESHAPES:
        return True
    return isinstance(op.target, OpDef) and op.target.namespace == "comm" and op.kwarg("reduce") in (None, "sum", "avg")


def _applied(chain: list[Op], old: Value, new: Value, into: list[Op], taken: set[str]) -> Value:
    """``chain`` (each op reading the one before; the first reads ``old``) applied to ``new``: copies
    appended to ``into``; the last copy's result."""
    for op in chain:
        results = tuple(Value(fresh_name(r.name, taken), r.type, r.layout) for r in op.results)
        swap = {old: new}
        into.append(
            dataclasses.replace(op, args=map_values(op.args, swap), kwargs=map_values(op.kwargs, swap), results=results)
        )  # type: ignore[arg-type]
        old, new = op.results[0], results[0]
    return new
