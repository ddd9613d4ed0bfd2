"""The values of an unrolled loop's body computed for every slice at once (``meshfold.rewrites.fold_scan``).

A body reads slice ``i`` of tensors from outside the loop and the state the body before it left. Its
*whole form* computes one value for every ``i`` at once: each read is the tensor itself with the
loop's dim moved first, and each op runs on whole forms with that dim as a leading batch dim (dims
counted from the front shift by one; every operand a body gives an op has the op's rank, so the
forms broadcast as the slices did; tensors from outside the loop broadcast against the trailing
dims as they did).

The state's update is traced as an affine function of the state (:class:`Aff`): ``m @ s + c`` for
the identity, a scalar per slice, or a matrix on the left; ``m * s + c`` element by element. That
gives ``affine_scan``'s ``m`` and ``b``; the states it returns stand for the state in the whole form,
and every other body value (the update itself included: the state after each step) is computed on
them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from meshfold.ir.dialects.scan import SCAN

_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
    torch.exp, torch.sigmoid, torch.tanh, F.silu, F.softplus, torch.add, torch.mul, torch.sub,
}  # fmt: skip
_METHODS = {"exp", "sigmoid", "tanh", "neg", "float", "to", "contiguous", "type_as"}
_DIM_METHODS = {"transpose", "swapaxes", "unsqueeze", "squeeze"}
_MATMUL = {operator.matmul, torch.matmul}
_PLACE = ("nn_module_stack", "stack_trace", "source_fn_stack")
"""What an emitted node takes from the body node it stands for: where in the model it is."""


class NoFold(Exception):
    """The loop is not an affine scan this pass knows; it is left as it is."""


@dataclass(frozen=True)
class Loop:
    """An unrolled loop: its first body, where in it the carried state is made, the state it starts
    from, its number of bodies, the stacks after it (``(node, position in a body, dim)``) and the
    last body's state."""

    body: list[fx.Node]
    state_at: int
    init: fx.Node
    n: int
    stacks: list[tuple[fx.Node, int, int]]
    last_state: fx.Node


@dataclass(frozen=True)
class Aff:
    """``a (x) state + c``: ``a`` is ``("one",)`` (the identity), ``("scale", node)`` (a scalar per
    slice: shape ``[..., 1, 1]``), ``("mat", node)`` (a matrix on the left) or ``("diag", node)``
    (element by element); ``c`` a whole form or None (zero)."""

    a: tuple[Any, ...]
    c: Any = None


@dataclass
class _Emitter:
    graph: fx.Graph
    loop: Loop
    whole: dict[fx.Node, Any] = field(default_factory=dict)
    aff: dict[fx.Node, Aff] = field(default_factory=dict)
    seen: set[fx.Node] = field(default_factory=set)

    def __post_init__(self) -> None:
        body, init = self.loop.body, self.loop.init
        self.inside = set(body)
        shape = _shape(body[self.loop.state_at])
        if shape is None or len(shape) < 2 or _shape(init) != shape:
            raise NoFold
        self.state_shape = shape
        self.on_state = {init}
        for n in body:
            if any(a in self.on_state for a in n.all_input_nodes):
                self.on_state.add(n)
        need = {body[self.loop.state_at]}
        for n in reversed(body):
            if n in need:
                need.update(a for a in n.all_input_nodes if a in self.on_state)
        self.path = need & self.on_state
        self.aff[init] = Aff(("one",))
        self.seen = set(self.graph.nodes)

    # -- the two passes ---------------------------------------------------------------------------

    def run(self) -> list[fx.Node]:
        loop, writes = self.loop, []
        for n in loop.body:
            if n in self.path:
                self.aff[n] = self.affine(n)
            elif n not in self.on_state and write(n) is None:
                self.whole[n] = self.vector(n)
            self.located(n)
        update = self.aff[loop.body[loop.state_at]]
        lead, (k, v) = self.state_shape[:-2], self.state_shape[-2:]
        diagonal = update.a[0] != "mat"
        m = self.expand(self.coefficient(update.a), (loop.n, *lead, k, v if diagonal else k))
        b = self.expand(update.c if update.c is not None else self.filled(0.0), (loop.n, *lead, k, v))
        args = (self.first_to(m, -3), self.first_to(b, -3), loop.init)
        h = self.graph.call_function(SCAN, args, {"diagonal": True} if diagonal else {})
        self.whole[loop.init] = self.graph.call_method("movedim", (h, -3, 0))
        self.located(loop.body[loop.state_at])
        for n in loop.body:
            w = write(n)
            if w is not None:
                writes.append(self.written(*w))
            elif n in self.on_state and n is not loop.init:
                self.whole[n] = self.vector(n)
            self.located(n)
        stacked = []
        for u, j, dim in loop.stacks:
            rank = len(_shape(loop.body[j]) or ())
            stacked.append((u, self.first_to(self.whole[loop.body[j]], dim if dim >= 0 else dim + rank + 1)))
        if loop.last_state.users:
            last = self.graph.call_method("select", (self.whole[loop.body[loop.state_at]], 0, -1))
            stacked.append((loop.last_state, last))
        self.located(loop.body[loop.state_at])
        # NOTE: nothing is rewired until every value has its whole form (a NoFold leaves the graph as it was)
        for target, out in writes:
            target.replace_all_uses_with(out, delete_user_cb=lambda u: write(u) is None)
        for u, out in stacked:
            u.replace_all_uses_with(out)
        return [target for target, _ in writes]

    def written(self, target: fx.Node, dim: int, value: Any) -> tuple[fx.Node, fx.Node]:
        """``(target, value's whole form)``, where ``target`` is a fresh tensor every slice of which a
        body writes, each slice with ``value``'s shape and dtype."""
        made = target.op == "call_function" and target.target in (torch.zeros_like, torch.zeros, torch.empty_like)
        t, x = target.meta.get("example_value"), getattr(value, "meta", {}).get("example_value")
        writes = [u for u in target.users if write(u) is not None]
        same = isinstance(t, torch.Tensor) and isinstance(x, torch.Tensor) and t.dtype == x.dtype
        if not (made and same and len(writes) == self.loop.n and value in self.whole):
            raise NoFold
        assert isinstance(t, torch.Tensor) and isinstance(x, torch.Tensor)
        if (*t.shape[:dim], *t.shape[dim + 1 :]) != tuple(x.shape):
            raise NoFold  # NOTE: a slice written by broadcasting
        return target, self.first_to(self.whole[value], dim)

    # -- whole forms ------------------------------------------------------------------------------

    def value(self, a: Any) -> Any:
        if isinstance(a, fx.Node) and a in self.whole:
            return self.whole[a]
        if isinstance(a, fx.Node) and (a in self.inside or a is self.loop.init):
            raise NoFold
        return a  # NOTE: a tensor from outside the loop, or a constant

    def vector(self, n: fx.Node) -> fx.Node:
        """``n``'s whole form."""
        p = pick(n)
        if p is not None and p[0] not in self.inside and p[0] is not self.loop.init:
            x, dim, _ = p
            if (s := _shape(x)) is None or s[dim] != self.loop.n:
                raise NoFold
            whole = self.first_to(x, dim, back=True)
            idx = n.args[1]
            if isinstance(idx, tuple) and None in idx:  # NOTE: the new dims the read adds
                rest = tuple(e for e in idx if type(e) is not int)
                whole = self.graph.call_function(operator.getitem, (whole, (slice(None), *rest)))
            return whole
        rank = self.ranked(n)
        args = [self.value(a) for a in n.args]
        kwargs = {k: self.value(v) for k, v in n.kwargs.items()}
        if any(isinstance(v, fx.Node) for v in kwargs.values()):
            raise NoFold
        if n.op == "call_function" and n.target is operator.getitem:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, (fx.Node, list)) for i in idx):
                raise NoFold
            return self.graph.call_function(operator.getitem, (args[0], (slice(None), *idx)))
        if n.op == "call_function" and (n.target in _FUNCTIONS or n.target in _MATMUL):
            return self.graph.call_function(n.target, tuple(args), kwargs)
        if n.op == "call_method" and n.target in _METHODS:
            return self.graph.call_method(str(n.target), tuple(args), kwargs)
        if n.op == "call_method" and n.target in _DIM_METHODS and not kwargs:
            dims = [d if not isinstance(d, int) or d < 0 else d + 1 for d in args[1:]]
            if not all(isinstance(d, int) for d in dims) or (n.target == "unsqueeze" and dims[0] < -rank):
                raise NoFold
            return self.graph.call_method(str(n.target), (args[0], *dims))
        raise NoFold

    def ranked(self, n: fx.Node) -> int:
        """The rank of ``n``'s slice; raises unless every operand a body gives it has that rank and
        every tensor from outside has no more."""
        shape = _shape(n)
        if shape is None:
            raise NoFold
        rank = len(shape)
        for a in n.all_input_nodes:
            if n.target is operator.getitem or (n.op == "call_method" and n.target in _DIM_METHODS):
                break  # NOTE: these change the rank; their operand is their own
            s = _shape(a)
            inner = a in self.inside or a is self.loop.init
            if s is None or (len(s) != rank if inner else len(s) > rank):
                raise NoFold
        return rank

    # -- the update, affine in the state -----------------------------------------------------------

    def affine(self, n: fx.Node) -> Aff:
        self.ranked(n)
        args = [self.aff.get(a, None) if isinstance(a, fx.Node) and a in self.aff else self.value(a) for a in n.args]
        fn = n.target if n.op == "call_function" else None
        if fn in _MATMUL and not isinstance(args[0], Aff) and isinstance(args[1], Aff) and not n.kwargs:
            y = args[1]
            if y.a[0] == "diag":
                raise NoFold  # NOTE: a matrix times an element-by-element scaled state
            c = None if y.c is None else self.graph.call_function(operator.matmul, (args[0], y.c))
            return Aff(("mat", self.times(args[0], y.a)), c)
        if fn in (operator.add, operator.sub, torch.add, torch.sub) and len(args) == 2 and not n.kwargs:
            y = self.scaled(args[1], -1.0) if fn in (operator.sub, torch.sub) else args[1]
            return self.add(args[0], y)
        if fn in (operator.mul, torch.mul) and len(args) == 2 and not n.kwargs:
            x, f, at = (args[0], args[1], 1) if isinstance(args[0], Aff) else (args[1], args[0], 0)
            if isinstance(f, Aff):
                raise NoFold  # NOTE: the state times itself
            scalar = not isinstance(f, fx.Node) or (_shape(n.args[at]) or (0,))[-2:] == (1, 1)
            return self.scaled(x, f) if scalar else self.diag(x, f)
        if fn is operator.neg:
            return self.scaled(args[0], -1.0)
        same = _dtype(n) is not None and _dtype(n) == _dtype(n.args[0])
        if n.op == "call_method" and n.target in ("to", "float", "contiguous", "type_as") and same:
            return args[0]  # NOTE: a cast to the dtype it has: the state itself
        raise NoFold

    def times(self, x: Any, a: tuple[Any, ...]) -> Any:
        """``x @ a`` (``a`` a coefficient of the state)."""
        if a[0] == "one":
            return x
        return self.graph.call_function(operator.mul if a[0] == "scale" else operator.matmul, (x, a[1]))

    def scaled(self, x: Any, s: Any) -> Any:
        if not isinstance(x, Aff):
            return self.graph.call_function(operator.mul, (x, s))
        a = ("scale", s) if x.a[0] == "one" else (x.a[0], self.graph.call_function(operator.mul, (x.a[1], s)))
        return Aff(a, None if x.c is None else self.graph.call_function(operator.mul, (x.c, s)))

    def diag(self, x: Aff, f: fx.Node) -> Aff:
        if x.a[0] == "mat":
            raise NoFold  # NOTE: element by element after a matrix: neither form
        a = f if x.a[0] == "one" else self.graph.call_function(operator.mul, (x.a[1], f))
        return Aff(("diag", a), None if x.c is None else self.graph.call_function(operator.mul, (x.c, f)))

    def add(self, x: Any, y: Any) -> Any:
        if not isinstance(x, Aff):
            x, y = y, x
        if not isinstance(y, Aff):
            return Aff(x.a, y if x.c is None else self.graph.call_function(operator.add, (x.c, y)))
        kinds = {x.a[0], y.a[0]}
        if {"mat", "diag"} <= kinds:
            raise NoFold
        a = ("mat" if "mat" in kinds else "diag", self.graph.call_function(
            operator.add, (self.coefficient(x.a, left="mat" in kinds), self.coefficient(y.a, left="mat" in kinds))
        ))  # fmt: skip
        c = y.c if x.c is None else x.c if y.c is None else self.graph.call_function(operator.add, (x.c, y.c))
        return Aff(a, c)

    # -- building ---------------------------------------------------------------------------------

    def coefficient(self, a: tuple[Any, ...], left: bool | None = None) -> Any:
        """A coefficient as a tensor: a matrix (``left``) or a factor element by element."""
        left = a[0] == "mat" if left is None else left
        if a[0] in ("mat", "diag"):
            return a[1]
        one = self.eye() if left else self.filled(1.0)
        return one if a[0] == "one" else self.graph.call_function(operator.mul, (a[1], one))

    def eye(self) -> fx.Node:
        example = self.loop.init.meta["example_value"]
        k = self.state_shape[-2]
        return self.graph.call_function(torch.eye, (k,), {"dtype": example.dtype, "device": example.device})

    def filled(self, value: float) -> fx.Node:
        example = self.loop.init.meta["example_value"]
        return self.graph.call_function(torch.full, ((), value), {"dtype": example.dtype, "device": example.device})

    def expand(self, x: Any, shape: tuple[int, ...]) -> fx.Node:
        return self.graph.call_method("expand", (x, *shape))

    def first_to(self, x: fx.Node, dim: int, back: bool = False) -> fx.Node:
        """``x`` with its first dim moved to ``dim`` (``back``: ``dim`` moved first)."""
        if dim == 0:
            return x
        return self.graph.call_method("movedim", (x, dim, 0) if back else (x, 0, dim))

    def located(self, where: fx.Node) -> None:
        """Give the nodes emitted since the last call ``where``'s module path and source line."""
        for n in self.graph.nodes:
            if n not in self.seen:
                self.seen.add(n)
                n.meta.update({k: v for k, v in where.meta.items() if k in _PLACE})


def one_int(idx: Any) -> tuple[int, int] | None:
    """``(dim, i)`` when ``idx`` indexes one dim by an int and takes the others whole (new dims,
    ``None``, may be added)."""
    if type(idx) is int:
        return 0, idx
    if not isinstance(idx, tuple):
        return None
    ints = [j for j, s in enumerate(idx) if type(s) is int]
    if len(ints) != 1 or any(s is not None and s != slice(None) for j, s in enumerate(idx) if j != ints[0]):
        return None
    return sum(s is not None for s in idx[: ints[0]]), idx[ints[0]]


def pick(n: fx.Node) -> tuple[fx.Node, int, int] | None:
    """``(x, dim, i)`` when ``n`` is ``x[:, ..., i, ..., :]``."""
    if n.op != "call_function" or n.target is not operator.getitem or _shape(n.args[0]) is None:
        return None
    at = one_int(n.args[1])
    return None if at is None else (n.args[0], *at)


def write(n: fx.Node) -> tuple[fx.Node, int, Any] | None:
    """``(target, dim, value)`` when ``n`` is ``target[:, ..., i, ..., :] = value``."""
    if n.op != "call_function" or n.target is not operator.setitem or not isinstance(n.args[0], fx.Node):
        return None
    at = one_int(n.args[1])
    return None if at is None else (n.args[0], at[0], n.args[2])


def emit(graph: fx.Graph, loop: Loop) -> list[fx.Node]:
    """Emit ``loop`` whole at the graph's insertion point; returns the tensors its bodies wrote into
    (now read by no one but the writes). Raises ``NoFold`` where the loop is not affine."""
    return _Emitter(graph, loop).run()


def _shape(n: Any) -> tuple[int, ...] | None:
    v = n.meta.get("example_value") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _dtype(n: Any) -> torch.dtype | None:
    v = n.meta.get("example_value") if isinstance(n, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None
