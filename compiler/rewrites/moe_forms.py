"""The forms of an MoE layer with an ``nn.ModuleList`` of experts that meshfold reads off dynamo's
forward graph, to fold it into one ``meshfold.moe_experts`` op (:mod:`meshfold.rewrites.moe_lists` rewrites).

Each expert is a gated MLP without biases, ``down(act(gate(x)) * up(x))`` (which linear is which comes
from how they are wired, not from their names): :func:`expert_body`. The layer combines the experts'
outputs in one of the two ways plain PyTorch MoE code does (:func:`combine_of`):

- the sparse loop: per expert ``e``, the tokens routed to it and which of their top-k choices it is,
  ``rows, slot = torch.where(top_k_index == e)`` or, with transformers v4 Mixtral's one-hot mask,
  ``slot, rows = torch.where(one_hot(top_k_index, E).permute(2, 1, 0)[e])``; the expert runs on
  ``hidden[rows]``, its output is scaled by ``top_k_weights[rows, slot, None]`` and ``index_add_``-ed into
  a zero-initialised result (shapes depend on the routing: this form cannot even be traced to a
  backward without folding);
- the dense stack: every expert runs on every token, ``torch.stack(outs, dim=1)`` is weighted by
  ``zeros.scatter(1, top_k_index, top_k_weights)`` and summed over the experts.

Both compute ``sum_j w[t, j] * expert_{i[t, j]}(hidden[t])``, which is the experts op.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

# NOTE: the activations ir.dialects.moe implements, as dynamo records the calls.
_ACTS = {F.silu: "silu", F.relu: "relu", torch.relu: "relu"}
_LINEAR = (F.linear, torch._C._nn.linear)


@dataclass
class ExpertBody:
    """One expert's body in the graph: ``down(act(gate(x)) * up(x))``."""

    x: fx.Node
    y: fx.Node
    gate: fx.Node
    up: fx.Node
    down: fx.Node
    act: str
    nodes: list[fx.Node]


def expert_body(nodes: list[fx.Node]) -> ExpertBody | None:
    """The expert's gated MLP, if ``nodes`` (one expert's graph nodes) are exactly one."""
    linears = [x for x in nodes if x.op == "call_function" and x.target in _LINEAR]
    acts = [x for x in nodes if x.op == "call_function" and (x.target in _ACTS or x.target is F.gelu)]
    muls = [x for x in nodes if x.op == "call_function" and x.target in (operator.mul, torch.mul)]
    weights = [x for x in nodes if x.op == "get_attr"]
    if len(linears) != 3 or len(acts) != 1 or len(muls) != 1 or len(weights) != 3 or len(nodes) != 8:
        return None
    if any((len(x.args) > 2 and x.args[2] is not None) or x.kwargs.get("bias") is not None for x in linears):
        return None
    mul, act = muls[0], acts[0]
    downs = [x for x in linears if x.args[0] is mul]
    act_name = _act_name(act)
    if len(downs) != 1 or len(mul.args) != 2 or act_name is None or len(act.args) != 1:
        return None
    down = downs[0]
    a, b = mul.args
    gate_lin, up_lin = (act.args[0], b) if a is act else (act.args[0], a) if b is act else (None, None)
    if gate_lin not in linears or up_lin not in linears or gate_lin is up_lin:
        return None
    assert isinstance(gate_lin, fx.Node) and isinstance(up_lin, fx.Node)
    x = gate_lin.args[0]
    if up_lin.args[0] is not x or not isinstance(x, fx.Node) or x in nodes:
        return None
    inner = {mul, act, gate_lin, up_lin, down, *weights}
    if any(set(node.users) - inner for node in (mul, act, gate_lin, up_lin)):
        return None
    gw, uw, dw = (lin.args[1] for lin in (gate_lin, up_lin, down))
    if not all(isinstance(w, fx.Node) and w.op == "get_attr" for w in (gw, uw, dw)):
        return None
    return ExpertBody(x, down, gw, uw, dw, act_name, list(nodes))  # type: ignore[arg-type]


def _act_name(act: fx.Node) -> str | None:
    """ir.dialects.moe's name for the activation ``act`` calls, or None."""
    if act.target is F.gelu:
        approximate = act.kwargs.get("approximate", "none")
        return (
            {"none": "gelu", "tanh": "gelu_tanh"}.get(str(approximate)) if set(act.kwargs) <= {"approximate"} else None
        )
    return _ACTS.get(act.target) if not act.kwargs else None  # type: ignore[call-overload]


@dataclass
class Combine:
    """How a layer combines its experts: the op's operands, where it goes, what it replaces."""

    hidden: fx.Node
    index: fx.Node
    weights: fx.Node
    after: fx.Node
    """The op is inserted after this node."""
    rewire: Callable[[fx.Node], None]
    """Points the layer's result at the op's output ``y``."""
    dead: list[fx.Node]
    """Nodes to erase, in graph order (expert weights excluded)."""
    dtype: torch.dtype | None = None
    """Cast the routing weights to this dtype first."""


def combine_of(body: list[ExpertBody]) -> Combine | None:
    """How the layer whose experts are ``body`` (in list order) combines their outputs, if in a form
    meshfold knows (module docstring)."""
    return _loop(body) or _dense(body)


def _loop(body: list[ExpertBody]) -> Combine | None:
    """The sparse loop: ``out.index_add_(0, rows, expert(hidden[rows]) * weights[rows, slot, None])``
    with ``rows``, ``slot`` the tokens routed to expert ``e`` and which of their top-k choices it is
    (:func:`_selection`), ``out`` a fresh tensor the loop adds into. The gather may also read
    ``hidden[None, rows].reshape(-1, H)`` and the scaled output be cast ``.to(dtype)`` before it is added
    (transformers v4's Mixtral)."""
    shared: tuple[object, ...] | None = None
    adds: list[fx.Node] = []
    dead: set[fx.Node] = set()
    masks: set[fx.Node] = set()
    for e, b in enumerate(body):
        gathered = _gathered(b.x)
        if gathered is None:
            return None
        src, rows, gather = gathered
        found = rows.args[0] if rows.target is operator.getitem else None
        selected = _selection(found, e, len(body)) if isinstance(found, fx.Node) else None
        if selected is None or rows.args[1] != selected[1]:
            return None
        index, at_rows, mask = selected
        users = list(b.y.users)
        if len(users) != 1 or users[0].target not in (operator.mul, torch.mul):
            return None
        scaled = users[0]
        scale = next((a for a in scaled.args if a is not b.y), None)
        if not (isinstance(scale, fx.Node) and scale.target is operator.getitem):
            return None
        table, at = scale.args
        if not (isinstance(at, tuple) and len(at) == 3 and at[0] is rows and at[2] is None):
            return None
        slot = at[1]
        if not (isinstance(slot, fx.Node) and slot.target is operator.getitem and slot.args == (found, 1 - at_rows)):
            return None
        added = _cast(scaled)
        adders = list(added.users)
        if len(adders) != 1 or adders[0].op != "call_method" or adders[0].target != "index_add_":
            return None
        add = adders[0]
        if add.args[1:] != (0, rows, added) or add.kwargs or add.users:
            return None
        here = (src, index, table, add.args[0])
        if shared is None:
            shared = here
        elif here != shared:
            return None
        adds.append(add)
        # NOTE: everything computed from the data-dependent positions goes: the gathers, the sizes
        # dynamo read off them and its runtime asserts on those sizes.
        assert isinstance(found, fx.Node)
        closure = _closure(found)
        picks = {x for x in closure if x.target is operator.getitem and x.args[0] is found}
        allowed = set(b.nodes) | picks | {found, *gather, scale, scaled, added, add} | _size_checks(closure)
        if not closure <= allowed:
            return None
        dead |= closure
        masks.update(mask)
    assert shared is not None
    hidden, index, weights, out = shared
    assert isinstance(out, fx.Node)
    order = {node: i for i, node in enumerate(out.graph.nodes)}
    last = max(adds, key=order.__getitem__)
    later = [u for u in out.users if u not in adds]
    if any(order[u] < order[last] for u in later):
        return None
    # NOTE: a mask node goes once only dead nodes read it (one one-hot mask serves every expert).
    for node in sorted(masks, key=order.__getitem__, reverse=True):
        if set(node.users) <= dead:
            dead.add(node)

    def rewire(y: fx.Node) -> None:
        total = y.graph.call_function(operator.add, (out, y))
        for u in later:
            u.replace_input_with(out, total)

    return Combine(hidden, index, weights, last, rewire, sorted(dead, key=order.__getitem__))  # type: ignore[arg-type]


def _selection(found: fx.Node, e: int, n: int) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """``found``, a ``torch.where``, as the tokens routed to expert ``e`` of ``n``: (the top-k index
    ``[T, k]`` it reads, which of its two outputs holds the tokens' rows (the other holds their top-k
    slot), the mask's nodes). Either ``where(index == e)``, which gives (rows, slot), or ``where(mask[e])``
    with ``mask = one_hot(index, n).permute(2, ...)``: the rows come out where the permute puts the token
    dimension (transformers v4 Mixtral's ``permute(2, 1, 0)`` gives (slot, rows))."""
    mask = found.args[0] if found.target is torch.where and len(found.args) == 1 and not found.kwargs else None
    if not isinstance(mask, fx.Node):
        return None
    if mask.target in (operator.eq, torch.eq) and mask.args[1] == e and isinstance(mask.args[0], fx.Node):
        return mask.args[0], 0, [mask]
    perm = mask.args[0] if mask.target is operator.getitem and mask.args[1] == e else None
    if not (isinstance(perm, fx.Node) and perm.target in ("permute", torch.permute) and not perm.kwargs):
        return None
    hot, *dims = perm.args
    dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
    if not (isinstance(hot, fx.Node) and hot.target is F.one_hot and isinstance(hot.args[0], fx.Node)):
        return None
    classes = hot.kwargs.get("num_classes", hot.args[1] if len(hot.args) > 1 else -1)
    # NOTE: one_hot(index) is [T, k, E]: the permute puts the experts first, then T and k in either order.
    axes = [d % 3 for d in dims if isinstance(d, int)]
    if classes != n or len(axes) != len(dims) or axes not in ([2, 0, 1], [2, 1, 0]):
        return None
    return hot.args[0], axes.index(0) - 1, [mask, perm, hot]


def _gathered(x: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(source, rows, the gather's nodes) when ``x``, which the gate and up linears read, is
    ``source[rows]``, or the same rows as ``source[None, rows].reshape(-1, H)`` of a 2-D ``source``."""
    if x.target is operator.getitem and len(x.users) == 2:
        src, rows = x.args
        return (src, rows, [x]) if isinstance(src, fx.Node) and isinstance(rows, fx.Node) else None
    inner = x.args[0] if x.op == "call_method" and x.target in ("reshape", "view") and len(x.users) == 2 else None
    if not (isinstance(inner, fx.Node) and inner.target is operator.getitem and len(inner.users) == 1):
        return None
    src, at = inner.args
    if not (isinstance(src, fx.Node) and isinstance(at, tuple) and len(at) == 2 and at[0] is None):
        return None
    rows, have, want = at[1], x.meta["example_value"].shape, src.meta["example_value"].shape
    if len(have) != 2 or len(want) != 2 or not statically_known_true(have[1] == want[1]):
        return None
    return (src, rows, [x, inner]) if isinstance(rows, fx.Node) else None


def _cast(scaled: fx.Node) -> fx.Node:
    """``scaled.to(dtype)`` when that is ``scaled``'s only use, else ``scaled``. (``index_add_`` takes
    only the result's dtype, and the experts op casts each scaled output to it as well.)"""
    users = list(scaled.users)
    if len(users) != 1 or users[0].op != "call_method" or users[0].target != "to" or users[0].kwargs:
        return scaled
    return users[0] if len(users[0].args) == 2 and isinstance(users[0].args[1], torch.dtype) else scaled


def _closure(root: fx.Node) -> set[fx.Node]:
    seen = {root}
    todo = [root]
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


_SIZE_OPS = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten._assert_scalar.default,
    operator.ge,
    operator.le,
    operator.lt,
    operator.gt,
    operator.eq,
    torch._check_is_size,
}


def _size_checks(nodes: set[fx.Node]) -> set[fx.Node]:
    """The nodes among ``nodes`` that only read or assert on sizes (dynamo's unbacked-size guards)."""
    return {x for x in nodes if x.target in _SIZE_OPS}


def _dense(body: list[ExpertBody]) -> Combine | None:
    """The dense stack: ``(zeros.scatter(1, index, weights)[..., None] * torch.stack(outs, 1)).sum(1)``."""
    hidden = body[0].x
    if any(b.x is not hidden for b in body) or any(len(b.y.users) != 1 for b in body):
        return None
    stack = next(iter(body[0].y.users))
    if stack.target is not torch.stack or list(stack.args[0]) != [b.y for b in body]:  # type: ignore[call-overload]
        return None
    if (stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim")) != 1 or len(stack.users) != 1:
        return None
    scaled = next(iter(stack.users))
    if scaled.target not in (operator.mul, torch.mul) or len(scaled.users) != 1:
        return None
    unsq = next((a for a in scaled.args if a is not stack), None)
    if not (isinstance(unsq, fx.Node) and unsq.op == "call_method" and unsq.target == "unsqueeze"):
        return None
    if unsq.args[1] not in (-1, 2) or len(unsq.users) != 1:
        return None
    dense = unsq.args[0]
    chain = [unsq]
    if isinstance(dense, fx.Node) and dense.op == "call_method" and dense.target == "to" and len(dense.users) == 1:
        chain.append(dense)
        dense = dense.args[0]
    if not (isinstance(dense, fx.Node) and dense.target in ("scatter", torch.scatter) and dense.args[1:2] == (1,)):
        return None
    base, _, index, weights = dense.args[:4]
    if not (isinstance(base, fx.Node) and base.target in (torch.zeros_like, torch.zeros)):
        return None
    if len(dense.users) == 1:
        chain.append(dense)
        if len(base.users) == 1:
            chain.append(base)
    summed = next(iter(scaled.users))
    if not (summed.op == "call_method" and summed.target == "sum"):
        return None
    dim = summed.args[1] if len(summed.args) > 1 else summed.kwargs.get("dim")
    if dim != 1 or summed.kwargs.get("keepdim", False):
        return None
    dtype = unsq.meta["example_value"].dtype
    order = {node: i for i, node in enumerate(stack.graph.nodes)}

    def rewire(y: fx.Node) -> None:
        summed.replace_all_uses_with(y)

    dead = {summed, scaled, stack, *chain}
    for b in body:
        dead |= {x for x in b.nodes if x.op != "get_attr"}
    erased = sorted(dead, key=order.__getitem__)
    return Combine(hidden, index, weights, summed, rewire, erased, dtype)  # type: ignore[arg-type]


__all__ = ["Combine", "ExpertBody", "combine_of", "expert_body"]
