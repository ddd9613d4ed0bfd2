"""Megatron tensor parallelism found from the graph's dataflow, not from module names.

A linear layer is ``mm``/``addmm`` of an activation with ``t(W)`` for a 2-D parameter ``W`` (or
float8's ``_scaled_mm`` of their float8 casts). Walking
forward from a linear's output through ops that keep the hidden dimension's meaning (elementwise
ops, views, transposes, attention), the first linears reached consume it: the first layer is
column-parallel (``W`` sharded on its output dim 0), those it feeds are row-parallel (dim 1). A
linear that feeds no other (an LM head) is column-parallel. Wrong guesses only cost
communication: propagation and boxing keep every result exact.
"""

from __future__ import annotations

from collections import deque

import torch

from meshfold.ir import Graph, Op, Target, Value, is_view

aten = torch.ops.aten

# NOTE: besides every view (``ir.is_view``), these keep the hidden dimension's meaning.
_TRANSPARENT = {
    aten.clone.default,
    aten._to_copy.default,
    aten.cat.default,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.mul.Scalar,
    aten.div.Tensor,
    aten.div.Scalar,
    aten.neg.default,
    aten.silu.default,
    aten.gelu.default,
    aten.relu.default,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.exp.default,
    aten.pow.Tensor_Scalar,
    aten.where.self,
    aten.repeat_interleave.self_int,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}


def _transparent(target: Target) -> bool:
    return is_view(target) or target in _TRANSPARENT


def _linear_weight(op: Op, params: set[Value], producers: dict[Value, Op]) -> tuple[Value, Value] | None:
    """(activation, weight parameter) when ``op`` is a forward linear layer, else None."""
    if op.prov.phase != "fwd":
        return None
    if op.target == aten.mm.default:
        act, wt = op.args[0], op.args[1]
    elif op.target == aten.addmm.default:
        act, wt = op.args[1], op.args[2]
    elif op.target == aten._scaled_mm.default:  # NOTE: float8: each factor reached through its cast
        act, wt = _uncast(op.args[0], producers), _uncast(op.args[1], producers)
    else:
        return None
    if not isinstance(wt, Value) or not isinstance(act, Value):
        return None
    t_op = producers.get(wt)
    if t_op is None or t_op.target != aten.t.default:
        return None
    w = t_op.args[0]
    return (act, w) if isinstance(w, Value) and w in params else None


_CASTS = (aten._to_copy.default, aten.clamp.default, aten.mul.Tensor, aten.clone.default)
"""What float8's cast of a factor is made of: scaled (``mul``), clamped to the format's range, converted."""


def _uncast(v: object, producers: dict[Value, Op]) -> object:
    """The value float8's cast of ``v`` started from (``v`` itself when it is none)."""
    while isinstance(v, Value) and v in producers and producers[v].target in _CASTS:
        v = producers[v].args[0]
    return v


def megatron_roles(graph: Graph) -> dict[str, str]:
    """Parameter name → ``"column"``, ``"row"`` (weights and column biases) or ``"vocab"`` (embedding
    tables, rows sharded); others are absent."""
    params = {i.value: i.name for i in graph.inputs if i.kind == "param"}
    producers = graph.producers()
    users = graph.users()
    linears: list[tuple[Op, Value, Value]] = []
    param_values = set(params)
    for op in graph.ops:
        found = _linear_weight(op, param_values, producers)
        if found is not None:
            linears.append((op, *found))
    by_activation: dict[Value, list[tuple[Op, Value]]] = {}
    for op, act, w in linears:
        by_activation.setdefault(act, []).append((op, w))
    roles: dict[str, str] = {}
    # NOTE: an embedding table is vocab-parallel (rows sharded), like the LM head it is often tied to.
    for op in graph.ops:
        if op.target == aten.embedding.default and op.prov.phase == "fwd" and op.args[0] in params:
            roles[params[op.args[0]]] = "vocab"  # type: ignore[index]
    for op, _act, w in linears:
        name = params[w]
        if name in roles:
            continue
        roles[name] = "column"
        if op.target == aten.addmm.default and isinstance(op.args[0], Value) and op.args[0] in params:
            roles.setdefault(params[op.args[0]], "column")
        for _row_op, row_w in _reached_linears(op.result, users, by_activation):
            roles.setdefault(params[row_w], "row")
    return roles


def _reached_linears(
    start: Value, users: dict[Value, list[Op]], by_activation: dict[Value, list[tuple[Op, Value]]]
) -> list[tuple[Op, Value]]:
    seen: set[Value] = {start}
    queue = deque([start])
    found: list[tuple[Op, Value]] = []
    while queue:
        v = queue.popleft()
        found.extend(by_activation.get(v, []))
        for op in users.get(v, []):
            if op.prov.phase != "fwd" or not _transparent(op.target):
                continue
            for r in op.results:
                if r not in seen:
                    seen.add(r)
                    queue.append(r)
    return found
