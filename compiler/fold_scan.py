"""A loop over chunks that carries a state updated linearly, made one ``meshfold.affine_scan``, in
the forward graph dynamo captures, before the backward is traced.

Chunked linear attention (the gated delta rule of DeltaNet and Qwen3-Next as HF writes it without
its kernels, a scalar-decay linear attention, a state-space scan) runs a Python loop over chunks::

    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + attn[:, :, i] @ v_new
        state = state * decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new

Dynamo unrolls it: ``n`` copies of one body, each reading slice ``i`` of some tensors along one dim
and the state the body before it left. Such a loop is a chain the sharding rules can only run on one
rank. Here it is recognised by its structure (every body the same ops on slice ``i`` of the same
tensors, one value carried from each body to the next) and each body's values are written as affine
functions of the state it reads, ``A @ state + c``, with ``A`` and ``c`` free of the state: the
slices are read whole (the chunk dim rides along as a batch dim), so ``A`` and ``c`` are computed
for every chunk at once. The carried state becomes ``affine_scan(m, b, s0)`` (``m`` and ``b`` the
state update's ``A`` and ``c``), each written output ``A @ h + c`` on the states it gives, and the
state after the last chunk, where the model reads it, ``m @ h + b`` of the last one.

The result computes the same function (the products are grouped differently, so floats round
differently, as after any reordering of a sum). A loop that does anything else (reads a body's value
after the loop other than the final state, multiplies the state from the right, applies a nonlinear
function to it, writes an output twice) is left as it is.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from meshfold.ir.scan import SCAN

_ELEMENTWISE = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.exp, torch.sigmoid}
_METHODS_ELEMENTWISE = {"exp", "sigmoid", "neg", "float", "to", "contiguous"}
_MATMUL = {operator.matmul, torch.matmul}
_PLACE = ("nn_module_stack", "stack_trace", "source_fn_stack")
"""What an emitted node takes from the body node it stands for: where in the model it is."""


@dataclass(frozen=True)
class _Aff:
    """``a @ state + c``: ``a`` is ``"I"`` (the identity), a ``("scale", node)`` (a scalar per chunk,
    shape ``[..., 1, 1]``) or a ``("mat", node)``; ``c`` a node or None (zero). Nodes are whole:
    every chunk at once."""

    a: Any
    c: fx.Node | None


class _NoFold(Exception):
    """The loop is not an affine scan this pass knows; it is left as it is."""


def _pick(n: fx.Node) -> tuple[fx.Node, int, int] | None:
    """``(x, dim, i)`` when ``n`` is ``x[:, ..., :, i]`` (an int after full slices)."""
    if n.op != "call_function" or n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
        return None
    idx = n.args[1]
    if isinstance(idx, int) and not isinstance(idx, bool):
        return n.args[0], 0, idx
    if isinstance(idx, tuple) and idx and type(idx[-1]) is int and all(s == slice(None) for s in idx[:-1]):
        return n.args[0], len(idx) - 1, idx[-1]
    return None


def _write(n: fx.Node) -> tuple[fx.Node, int, int, Any] | None:
    """``(target, dim, i, value)`` when ``n`` is ``target[:, ..., :, i] = value``."""
    if n.op != "call_function" or n.target is not operator.setitem or not isinstance(n.args[0], fx.Node):
        return None
    idx = n.args[1]
    if isinstance(idx, tuple) and idx and type(idx[-1]) is int and all(s == slice(None) for s in idx[:-1]):
        return n.args[0], len(idx) - 1, idx[-1], n.args[2]
    return None


def _index(idx: Any) -> int:
    return idx if isinstance(idx, int) else idx[-1]


def _strip(idx: Any) -> Any:
    return () if isinstance(idx, int) else idx[:-1]


def _shape(n: Any) -> tuple[int, ...] | None:
    v = n.meta.get("example_value") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def fold_scans(gm: fx.GraphModule) -> int:
    """Fold every affine loop over chunks in ``gm`` (module docstring); returns how many."""
    folded = 0
    start = 0
    while (loop := _next_loop(gm.graph, start)) is not None:
        bodies, first = loop
        try:
            _fold(gm.graph, bodies)
            folded += 1
        except _NoFold:
            start = first + 1
            continue
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _next_loop(graph: fx.Graph, start: int) -> tuple[list[list[fx.Node]], int] | None:
    """The bodies of the first unrolled loop whose slice-0 read sits at or after position ``start``
    (and that position): from that read on, nodes are tagged by the largest slice index they depend
    on, counting the reads along its dim whose index goes up by one at a time; a read of slice 0
    again starts another loop, which ends this one's reads."""
    nodes = list(graph.nodes)
    for pos in range(start, len(nodes)):
        p = _pick(nodes[pos])
        if p is None or p[2] != 0:
            continue
        dim, cur, closed = p[1], 0, False
        tag: dict[fx.Node, int] = {}
        bodies: dict[int, list[fx.Node]] = defaultdict(list)
        for n in nodes[pos:]:
            q = _pick(n)
            inputs = [tag[a] for a in n.all_input_nodes if a in tag]
            read = q is not None and q[1] == dim and q[0] not in tag
            if read and not closed and q is not None and q[2] in (cur, cur + 1):
                cur = q[2]
                tag[n] = max([cur, *inputs])
            elif read and q is not None and q[2] == 0:
                closed = True
                continue
            elif inputs:
                tag[n] = max(inputs)
            else:
                continue
            bodies[tag[n]].append(n)
        if cur >= 1:
            return [bodies[i] for i in range(cur + 1)], pos
    return None


def _fold(graph: fx.Graph, bodies: list[list[fx.Node]]) -> None:
    """Rewrite one loop (module docstring), or raise ``_NoFold`` having changed nothing."""
    size = len(bodies[0])
    if any(len(b) != size for b in bodies[1:-1]) or len(bodies[-1]) < size:
        raise _NoFold
    after = bodies[-1][size:]
    bodies = [*bodies[:-1], bodies[-1][:size]]
    position = [{n: j for j, n in enumerate(b)} for b in bodies]
    carried = _carried(bodies, position)
    if carried is None:
        raise _NoFold
    state_at, init = carried
    last_state = bodies[-1][state_at]
    inside = {n for b in bodies for n in b}
    # NOTE: after the loop only the final state may be read (by nodes tagged with the last index)
    if any(a in inside and a is not last_state for n in after for a in n.all_input_nodes):
        raise _NoFold
    if any(u not in inside for b in bodies[:-1] for n in b for u in n.users):
        raise _NoFold
    before = set(graph.nodes)
    try:
        with graph.inserting_before(bodies[0][0]):
            targets = _Emitter(graph, bodies[0], state_at, init, len(bodies)).emit(last_state)
    except _NoFold:
        for n in reversed(list(graph.nodes)):
            if n not in before:
                graph.erase_node(n)
        raise
    for b in reversed(bodies):
        for n in reversed(b):
            graph.erase_node(n)
    for t in targets:
        if not t.users:
            graph.erase_node(t)


def _carried(bodies: list[list[fx.Node]], position: list[dict[fx.Node, int]]) -> tuple[int, fx.Node] | None:
    """``(j, s0)``: each body reads the previous body's node ``j`` (and the first reads ``s0``) where
    the others read nothing of another body; None unless every body is the first's ops on its own
    slice index, and exactly one value is carried."""
    state_at: int | None = None
    init: fx.Node | None = None
    for i, body in enumerate(bodies):
        for j, n in enumerate(body):
            ref = bodies[0][j]
            if (n.op, n.target) != (ref.op, ref.target) or len(n.args) != len(ref.args) or n.kwargs != ref.kwargs:
                return None
            indexed = _pick(ref) is not None or _write(ref) is not None
            for slot, (a, r) in enumerate(zip(n.args, ref.args, strict=True)):
                if isinstance(a, fx.Node):
                    if a in position[i]:
                        ok = position[i][a] == position[0].get(r)
                    elif i and a in position[i - 1]:
                        k = position[i - 1][a]
                        if state_at not in (None, k) or (init is not None and r is not init) or r in position[0]:
                            return None
                        state_at, init, ok = k, r, True
                    else:
                        ok = a is r
                elif indexed and slot == 1:
                    ok = _index(a) - _index(r) == i and _strip(a) == _strip(r)
                else:
                    ok = a == r
                if not ok:
                    return None
    if state_at is None or init is None:
        return None
    return state_at, init


class _Emitter:
    """Writes the loop whole: ``A``/``c`` of each body value, then the scan and what reads it."""

    def __init__(self, graph: fx.Graph, body: list[fx.Node], state_at: int, init: fx.Node, n_steps: int) -> None:
        self.graph, self.body, self.init, self.n = graph, body, init, n_steps
        self.state_at = state_at
        self.env: dict[fx.Node, Any] = {init: _Aff("I", None)}
        self.dim: int | None = None
        shape = _shape(body[state_at])
        if shape is None or len(shape) < 2 or _shape(init) != shape:
            raise _NoFold
        self.state_shape = shape
        self.seen = set(graph.nodes)

    def call(self, target: Any, *args: Any) -> fx.Node:
        return self.graph.call_function(target, args)

    def located(self, where: fx.Node) -> None:
        """Give the nodes emitted since the last call ``where``'s module path and source line."""
        for n in self.graph.nodes:
            if n not in self.seen:
                self.seen.add(n)
                n.meta.update({k: v for k, v in where.meta.items() if k in _PLACE})

    def emit(self, last_state: fx.Node) -> list[fx.Node]:
        """Emit the loop whole; returns the tensors the bodies wrote into (now unread)."""
        writes: list[tuple[fx.Node, fx.Node, Any]] = []
        for n in self.body:
            w = _write(n)
            if w is None:
                self.env[n] = self.value_of(n)
                self.located(n)
                continue
            target, value = w[0], w[3]
            if not isinstance(value, fx.Node) or not _fresh(target, self.n, value):
                raise _NoFold
            writes.append((target, value, self.value(value)))
        state = self.env[self.body[self.state_at]]
        lead, (k, v) = self.state_shape[:-2], self.state_shape[-2:]
        if not isinstance(state, _Aff) or self.dim != len(lead):
            raise _NoFold
        m = self.expand(self.matrix(state.a), (*lead, self.n, k, k))
        c = state.c if state.c is not None else self.zeros()
        b = self.expand(c, (*lead, self.n, k, v))
        h = self.call(SCAN, m, b, self.init)
        outs = [(target, self.apply(whole, h)) for target, _, whole in writes]
        for target, out in outs:
            target.replace_all_uses_with(out, delete_user_cb=lambda u: _write(u) is None)
        if last_state.users:
            last = self.apply(_Aff(("mat", self.select_last(m)), self.select_last(b)), self.select_last(h))
            last_state.replace_all_uses_with(last)
        self.located(self.body[self.state_at])
        return [t for t, _, _ in writes]

    # -- values ---------------------------------------------------------------------------------

    def value(self, a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        if a in self.env:
            return self.env[a]
        raise _NoFold  # NOTE: a tensor from outside the loop other than the state

    def value_of(self, n: fx.Node) -> Any:
        p = _pick(n)
        if p is not None:
            x, dim, _ = p
            if self.dim not in (None, dim) or (s := _shape(x)) is None or s[dim] != self.n:
                raise _NoFold
            self.dim = dim
            return x
        if n.kwargs or _shape(n) is None:
            raise _NoFold
        # NOTE: no broadcasting across ranks: every slice has the rank of the result, so their whole
        # forms (the chunk dim added at the same place) broadcast as the slices did
        rank = len(_shape(n) or ())
        if any(isinstance(a, fx.Node) and len(_shape(a) or ()) != rank for a in n.args[:2]):
            raise _NoFold
        args = [self.value(a) for a in n.args]
        fn = n.target if n.op == "call_function" else None
        if fn in _MATMUL:
            return self.matmul(args[0], args[1])
        if fn in (operator.add, operator.sub):
            return self.add(args[0], args[1], fn is operator.sub)
        if fn is operator.mul:
            return self.mul(n, args[0], args[1])
        if fn is operator.neg:
            return self.scaled(args[0], -1.0)
        if any(isinstance(a, _Aff) for a in args):
            raise _NoFold  # NOTE: anything else on the state is not affine
        if n.op == "call_method" and n.target in ("transpose", "swapaxes"):
            if not all(isinstance(d, int) and d < 0 and -d <= rank - self._dim() for d in args[1:]):
                raise _NoFold
            return self.graph.call_method(n.target, tuple(args))
        if n.op == "call_method" and n.target in _METHODS_ELEMENTWISE:
            return self.graph.call_method(str(n.target), tuple(args))
        if fn in _ELEMENTWISE:
            return self.call(fn, *args)
        raise _NoFold

    def _dim(self) -> int:
        if self.dim is None:
            raise _NoFold
        return self.dim

    def matmul(self, x: Any, y: Any) -> Any:
        if not isinstance(x, fx.Node):
            raise _NoFold  # NOTE: the state multiplied from the right
        if not isinstance(y, _Aff):
            return self.call(operator.matmul, x, y)
        return _Aff(("mat", self.times(y.a, x)), None if y.c is None else self.call(operator.matmul, x, y.c))

    def times(self, a: Any, x: fx.Node) -> fx.Node:
        """``x @ a`` for a state coefficient ``a``."""
        if a == "I":
            return x
        return self.call(operator.mul if a[0] == "scale" else operator.matmul, x, a[1])

    def add(self, x: Any, y: Any, sub: bool) -> Any:
        op = operator.sub if sub else operator.add
        if not isinstance(x, _Aff) and not isinstance(y, _Aff):
            return self.call(op, x, y)
        if not isinstance(x, _Aff):  # NOTE: c - (a s + d) = (-a) s + (c - d)
            return self.add(self.scaled(y, -1.0) if sub else y, x, False)
        y_neg = self.scaled(y, -1.0) if sub else y
        if not isinstance(y_neg, _Aff):
            return _Aff(x.a, y_neg if x.c is None else self.call(operator.add, x.c, y_neg))
        c = y_neg.c if x.c is None else x.c if y_neg.c is None else self.call(operator.add, x.c, y_neg.c)
        return _Aff(("mat", self.call(operator.add, self.matrix(x.a), self.matrix(y_neg.a))), c)

    def mul(self, n: fx.Node, x: Any, y: Any) -> Any:
        if not isinstance(x, _Aff) and not isinstance(y, _Aff):
            return self.call(operator.mul, x, y)
        if isinstance(x, _Aff) and isinstance(y, _Aff):
            raise _NoFold  # NOTE: the state times itself
        factor, slot = (y, 1) if isinstance(x, _Aff) else (x, 0)
        if isinstance(factor, fx.Node) and (_shape(n.args[slot]) or ())[-2:] != (1, 1):
            raise _NoFold  # NOTE: only a scalar per chunk (and leading index) scales the state
        return self.scaled(x if isinstance(x, _Aff) else y, factor)

    def scaled(self, x: Any, s: Any) -> Any:
        if not isinstance(x, _Aff):
            return self.call(operator.mul, x, s)
        a: Any = ("scale", s) if x.a == "I" else (x.a[0], self.call(operator.mul, x.a[1], s))
        return _Aff(a, None if x.c is None else self.call(operator.mul, x.c, s))

    # -- building ---------------------------------------------------------------------------------

    def matrix(self, a: Any) -> fx.Node:
        if a != "I" and a[0] == "mat":
            return a[1]
        example = self.init.meta["example_value"]
        k = self.state_shape[-2]
        eye = self.graph.call_function(torch.eye, (k,), {"dtype": example.dtype, "device": example.device})
        return eye if a == "I" else self.call(operator.mul, a[1], eye)

    def zeros(self) -> fx.Node:
        example = self.init.meta["example_value"]
        return self.graph.call_function(torch.zeros, ((),), {"dtype": example.dtype, "device": example.device})

    def expand(self, x: fx.Node, shape: tuple[int, ...]) -> fx.Node:
        return self.graph.call_method("expand", (x, *shape))

    def select_last(self, x: fx.Node) -> fx.Node:
        return self.graph.call_method("select", (x, self._dim(), -1))

    def apply(self, value: Any, h: fx.Node) -> fx.Node:
        """A body value's whole form on the states ``h``."""
        if not isinstance(value, _Aff):
            if not isinstance(value, fx.Node):
                raise _NoFold
            return value
        mat = value.a != "I" and value.a[0] == "mat"
        on = self.call(operator.matmul, value.a[1], h) if mat else self.times(value.a, h)
        return on if value.c is None else self.call(operator.add, on, value.c)


def _fresh(target: fx.Node, n: int, value: fx.Node) -> bool:
    """``target`` is a new tensor of ``value``'s dtype that ``n`` bodies write slice by slice."""
    made = target.op == "call_function" and target.target in (torch.zeros_like, torch.zeros, torch.empty_like)
    t, v = target.meta.get("example_value"), value.meta.get("example_value")
    writes = [u for u in target.users if _write(u) is not None]
    same = isinstance(t, torch.Tensor) and isinstance(v, torch.Tensor) and t.dtype == v.dtype
    return made and same and len(writes) == n
