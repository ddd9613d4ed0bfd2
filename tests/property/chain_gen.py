"""Random op chains as IR text, for the property tests of tests/property/test_chains_on_ranks.py.

A chain starts from one ``param`` and applies 3 or more ops drawn from the rule table, each taking
the previous op's result (the "head") and, where the op needs more operands, earlier values or
fresh params (at most :data:`MAX_PARAMS`). Result types come from running each op on meta tensors,
so the text is well typed by construction. Every param gets a random layout on the (2, 2)
``("dp", "tp")`` mesh: ``R``, ``S(d)`` for a dim of size >= 4, or ``P`` (Partial sum).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

from ir import resolve_target, tensor_type

MESH_HEADER = "graph @chain mesh<dp=2, tp=2> {"
MAX_PARAMS = 4
SIZES = (4, 8, 16)
# NOTE: a result whose typical magnitude may exceed this is divided by a power of two (exact in fp32),
# so values stay O(1) and fp32 rounding (which differs between sharded and whole computation) stays
# far below the test's tolerance however many products and sums the chain stacks.
RESCALE_ABOVE = 4.0


@dataclass(frozen=True)
class Chain:
    """One example: the unsharded graph's text, each param's ``{axis: placement}`` and a data seed."""

    text: str
    layouts: dict[str, dict[str, str]]
    seed: int

    def __str__(self) -> str:
        plan = ", ".join(f"{n}: dp={a['dp']} tp={a['tp']}" for n, a in self.layouts.items())
        return f"{self.text}// layouts: {plan}\n// seed: {self.seed}\n"


@dataclass(frozen=True)
class Ref:
    """A value of the chain under construction: its name, a meta tensor of its type, a magnitude bound."""

    name: str
    meta: torch.Tensor
    mag: float

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.meta.shape)


@dataclass
class Builder:
    """Writes the chain's IR lines; every op is run on meta tensors to get its result type."""

    params: list[Ref] = field(default_factory=list)
    values: list[Ref] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def param(self, shape: tuple[int, ...]) -> Ref:
        ref = Ref(f"p{len(self.params)}", torch.empty(shape, device="meta"), 1.0)
        self.params.append(ref)
        self.values.append(ref)
        return ref

    def room(self) -> bool:
        return len(self.params) < MAX_PARAMS

    def op(self, target: str, args: tuple[Any, ...], mag: float) -> Ref:
        """Append ``%vN = target(args)`` and return its result."""
        fn = resolve_target(target)
        meta = fn(*(_meta(a) for a in args))
        name = f"v{len(self.values) - len(self.params) + 1}"
        ref = Ref(name, meta, mag)
        self.values.append(ref)
        self.lines.append(f"  %{name} = {target}({', '.join(_text(a) for a in args)}) : {tensor_type(meta)}")
        if mag > RESCALE_ABOVE and meta.dtype.is_floating_point:
            return self.op("aten.div.Scalar", (ref, float(2 ** math.ceil(math.log2(mag)))), 1.0)
        return ref

    def text(self, out: Ref) -> str:
        head = [MESH_HEADER, *(f"  param %{p.name} : {tensor_type(p.meta)}" for p in self.params)]
        return "\n".join([*head, *self.lines, f"  output out(0) = %{out.name}", "}"]) + "\n"


def _meta(a: Any) -> Any:
    if isinstance(a, Ref):
        return a.meta
    if isinstance(a, (tuple, list)):
        return [_meta(x) for x in a]
    return a


def _text(a: Any) -> str:
    if isinstance(a, Ref):
        return "%" + a.name
    if isinstance(a, (tuple, list)):
        return "[" + ", ".join(_text(x) for x in a) + "]"
    return repr(a) if isinstance(a, float) else str(a)


Draw = st.DrawFn
OpMaker = Callable[[Draw, Builder, Ref], Ref]


def _broadcasts_into(shape: tuple[int, ...], into: tuple[int, ...]) -> bool:
    """``shape`` broadcasts to ``into`` without changing it."""
    if len(shape) > len(into):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(into), strict=False))


def _partner(draw: Draw, b: Builder, head: Ref, *, fresh: bool = False) -> Ref:
    """A second operand for an elementwise op with ``head``: an earlier value that broadcasts into the
    head's shape (or the head into it), a fresh param of a compatible shape (always when ``fresh``),
    or the head itself."""
    known = [
        v
        for v in b.values
        if v is not head and (_broadcasts_into(v.shape, head.shape) or _broadcasts_into(head.shape, v.shape))
    ]
    choices = [*(["fresh"] if b.room() else []), "self", *(["known"] if known else [])]
    how = "fresh" if fresh else draw(st.sampled_from(choices))
    if how == "known":
        return draw(st.sampled_from(known))
    if how == "self":
        return head
    shape = list(head.shape)
    form = draw(st.sampled_from(["same", "suffix", "ones", "bigger"]))
    if form == "suffix" and shape:
        shape = shape[draw(st.integers(1, len(shape))) :]
    elif form == "ones" and shape:
        shape = [1 if draw(st.booleans()) else s for s in shape]
    elif form == "bigger" and len(shape) < 3:
        shape = [draw(st.sampled_from(SIZES)), *shape]
    return b.param(tuple(shape))


def _unary(draw: Draw, b: Builder, x: Ref) -> Ref:
    name = draw(st.sampled_from(["tanh", "sigmoid", "relu", "neg", "abs", "sin", "gelu", "silu", "clone"]))
    bounded = name in ("tanh", "sigmoid", "sin")
    return b.op(f"aten.{name}", (x,), 1.0 if bounded else x.mag)


def _exp(draw: Draw, b: Builder, x: Ref) -> Ref:
    return b.op("aten.exp", (x,), 2.72**x.mag)


def _scalar(draw: Draw, b: Builder, x: Ref) -> Ref:
    name = draw(st.sampled_from(["mul.Scalar", "add.Scalar", "div.Scalar", "pow.Tensor_Scalar"]))
    c = draw(st.sampled_from([0.5, -2.0, 3.0]))
    if name == "pow.Tensor_Scalar":
        return b.op("aten.pow.Tensor_Scalar", (x, 2), x.mag**2)
    mag = {"mul.Scalar": x.mag * abs(c), "add.Scalar": x.mag + abs(c), "div.Scalar": x.mag / abs(c)}[name]
    return b.op(f"aten.{name}", (x, c), mag)


def _binary(draw: Draw, b: Builder, x: Ref, *, fresh: bool = False) -> Ref:
    name = draw(st.sampled_from(["add.Tensor", "mul.Tensor", "sub.Tensor", "maximum"]))
    y = _partner(draw, b, x, fresh=fresh)
    args = (x, y) if draw(st.booleans()) else (y, x)
    mag = x.mag * y.mag if name == "mul.Tensor" else x.mag + y.mag
    return b.op(f"aten.{name}", args, mag)


def _where(draw: Draw, b: Builder, x: Ref) -> Ref:
    y = _partner(draw, b, x)
    z = draw(st.sampled_from([x, y]))
    cond = b.op("aten.gt.Scalar", (z, 0.0), 1.0)
    args = (cond, x, y) if draw(st.booleans()) else (cond, y, x)
    return b.op("aten.where.self", args, max(x.mag, y.mag))


def _matrix(draw: Draw, b: Builder, k: int, batch: tuple[int, ...], fallback: Ref) -> Ref:
    """A ``batch + (k, n)`` operand: an earlier value of that form, a fresh param, or ``fallback``."""
    known = [v for v in b.values if len(v.shape) == len(batch) + 2 and v.shape[: len(batch) + 1] == (*batch, k)]
    choices = [*(["known"] if known else []), *(["fresh"] if b.room() else [])] or ["fallback"]
    how = draw(st.sampled_from(choices))
    if how == "known":
        return draw(st.sampled_from(known))
    if how == "fresh":
        return b.param((*batch, k, draw(st.sampled_from(SIZES))))
    return fallback


def _mm(draw: Draw, b: Builder, x: Ref) -> Ref:
    m, k = x.shape
    form = draw(st.sampled_from(["mm", "mm-left", "addmm"]))
    if form == "mm-left":
        # NOTE: head on the right: (w: [n, m]) @ (x: [m, k]); w is found as a [m, n] value, transposed.
        w = _matrix(draw, b, m, (), x)
        wt = b.op("aten.t", (w,), w.mag)
        return b.op("aten.mm", (wt, x), wt.mag * x.mag * m**0.5)
    w = _matrix(draw, b, k, (), x)
    if w is x:
        w = b.op("aten.t", (x,), x.mag)
    if form == "addmm" and b.room():
        n = w.shape[1]
        bias = b.param((n,) if draw(st.booleans()) else (m, n))
        return b.op("aten.addmm", (bias, x, w), x.mag * w.mag * k**0.5 + 1.0)
    return b.op("aten.mm", (x, w), x.mag * w.mag * k**0.5)


def _bmm(draw: Draw, b: Builder, x: Ref) -> Ref:
    bs, _, k = x.shape
    w = _matrix(draw, b, k, (bs,), x)
    if w is x:
        w = b.op("aten.transpose.int", (w, 1, 2), w.mag)
    return b.op("aten.bmm", (x, w), x.mag * w.mag * k**0.5)


def _reduce(draw: Draw, b: Builder, x: Ref) -> Ref:
    rank = len(x.shape)
    name = draw(st.sampled_from(["sum.dim_IntList", "mean.dim", "amax"]))
    dims = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank)))
    if draw(st.booleans()):
        dims = [d - rank for d in dims]
    keepdim = draw(st.booleans())
    n = 1
    for d in dims:
        n *= x.shape[d]
    mag = x.mag * n**0.5 if name == "sum.dim_IntList" else x.mag
    return b.op(f"aten.{name}", (x, dims, keepdim), mag)


def _sum_all(draw: Draw, b: Builder, x: Ref) -> Ref:
    return b.op("aten.sum", (x,), x.mag * x.meta.numel() ** 0.5)


def _reshape(draw: Draw, b: Builder, x: Ref) -> Ref:
    shape = list(x.shape)
    i = draw(st.integers(0, len(shape) - 1))
    splits = [f for f in (2, 4) if shape[i] % f == 0 and shape[i] > f]
    if i + 1 < len(shape) and (not splits or draw(st.booleans())):
        new = [*shape[:i], shape[i] * shape[i + 1], *shape[i + 2 :]]
    elif splits and len(shape) < 4:
        f = draw(st.sampled_from(splits))
        new = [*shape[:i], f, shape[i] // f, *shape[i + 1 :]]
    else:
        new = [x.meta.numel()]
    # NOTE: a view of a non-contiguous value (after a transpose) is invalid even globally.
    target = draw(st.sampled_from(["aten.view", "aten.reshape"])) if x.meta.is_contiguous() else "aten.reshape"
    return b.op(target, (x, new), x.mag)


def _transpose(draw: Draw, b: Builder, x: Ref) -> Ref:
    rank = len(x.shape)
    form = draw(st.sampled_from(["transpose", "permute", "t"] if rank == 2 else ["transpose", "permute"]))
    if form == "t":
        return b.op("aten.t", (x,), x.mag)
    if form == "permute":
        perm = draw(st.permutations(list(range(rank))))
        return b.op("aten.permute", (x, perm), x.mag)
    d0, d1 = draw(st.integers(0, rank - 1)), draw(st.integers(-rank, rank - 1))
    return b.op("aten.transpose.int", (x, d0, d1), x.mag)


def _unsqueeze(draw: Draw, b: Builder, x: Ref) -> Ref:
    return b.op("aten.unsqueeze", (x, draw(st.integers(0, len(x.shape)))), x.mag)


def _ones(draw: Draw, b: Builder, x: Ref) -> Ref:
    """Remove or widen a size-1 dim: ``squeeze.dim`` or ``expand`` to a real size."""
    ones = [d for d, s in enumerate(x.shape) if s == 1]
    d = draw(st.sampled_from(ones))
    if draw(st.booleans()):
        return b.op("aten.squeeze.dim", (x, d), x.mag)
    sizes = [draw(st.sampled_from(SIZES)) if e == d else -1 for e in range(len(x.shape))]
    return b.op("aten.expand", (x, sizes), x.mag)


def _softmax(draw: Draw, b: Builder, x: Ref) -> Ref:
    rank = len(x.shape)
    dim = draw(st.integers(-rank, rank - 1))
    if draw(st.booleans()):
        return b.op("aten._softmax", (x, dim, False), 1.0)
    return b.op("aten._log_softmax", (x, dim, False), x.mag + 3.0)


def _cat(draw: Draw, b: Builder, x: Ref) -> Ref:
    rank = len(x.shape)
    dim = draw(st.integers(0, rank - 1))
    rest = x.shape[:dim] + x.shape[dim + 1 :]
    fits = [v for v in b.values if len(v.shape) == rank and v.shape[:dim] + v.shape[dim + 1 :] == rest]
    choices = ["known", *(["fresh"] if b.room() else [])]
    if draw(st.sampled_from(choices)) == "fresh":
        shape = list(x.shape)
        shape[dim] = draw(st.sampled_from(SIZES))
        y = b.param(tuple(shape))
    else:
        y = draw(st.sampled_from(fits))
    args = [x, y] if draw(st.booleans()) else [y, x]
    return b.op("aten.cat", (args, dim - rank if draw(st.booleans()) else dim), max(x.mag, y.mag))


def _slice(draw: Draw, b: Builder, x: Ref) -> Ref:
    dims = [d for d, s in enumerate(x.shape) if s >= 4]
    d = draw(st.sampled_from(dims))
    size = x.shape[d]
    start = draw(st.sampled_from([0, size // 4, size // 2]))
    return b.op("aten.slice.Tensor", (x, d, start, size), x.mag)


def applicable(x: Ref, b: Builder, *, last: bool) -> list[OpMaker]:
    """The op families that can take ``x`` as their head, simplest first (hypothesis shrinks toward
    the front); a family listed twice is drawn twice as often."""
    rank = len(x.shape)
    out: list[OpMaker] = [_unary, _binary, _scalar, _binary, _where]
    if x.mag <= RESCALE_ABOVE:
        out.append(_exp)
    if rank >= 1:
        out += [_reduce, _reduce, _transpose, _softmax, _cat, _reshape]
    if rank >= 1 and any(s >= 4 for s in x.shape):
        out.append(_slice)
    if rank < 3 or (rank < 4 and last):
        out.append(_unsqueeze)
    if 1 in x.shape:
        out += [_ones, _ones]
    if rank == 2:
        out += [_mm, _mm, _mm]
    if rank == 3:
        out += [_bmm, _bmm]
    if rank >= 1 and last:
        out.append(_sum_all)
    return out


def _layout(draw: Draw, shape: tuple[int, ...]) -> dict[str, str]:
    dims = [d for d, s in enumerate(shape) if s % 4 == 0]
    options = ["R", *(f"S({d})" for d in dims), "P"]
    return {"dp": draw(st.sampled_from(options)), "tp": draw(st.sampled_from(options))}


@st.composite
def chains(draw: Draw, min_ops: int = 3, max_ops: int = 6) -> Chain:
    """A random :class:`Chain` of ``min_ops`` to ``max_ops`` drawn ops (plus the transposes and
    conditions some of them add) over 2 to 4 params."""
    b = Builder()
    rank = draw(st.sampled_from([2, 3, 1]))
    head = b.param(tuple(draw(st.sampled_from(SIZES)) for _ in range(rank)))
    n = draw(st.integers(min_ops, max_ops))
    for i in range(n):
        make = draw(st.sampled_from(applicable(head, b, last=i == n - 1)))
        head = make(draw, b, head)
    while len(b.params) < 2:
        head = _binary(draw, b, head, fresh=True)
    layouts = {p.name: _layout(draw, p.shape) for p in b.params}
    return Chain(b.text(head), layouts, draw(st.integers(0, 2**31 - 1)))
