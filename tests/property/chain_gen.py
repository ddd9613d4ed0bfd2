"""Random op chains for the property tests of tests/property/test_chains_on_ranks.py.

A chain starts from one ``param`` and applies 3 or more ops drawn from the rule table, each taking
the previous op's result (the "head") and, where the op needs more operands, earlier values or
fresh params (at most :data:`~tests.property.chain_ir.MAX_PARAMS`). Every param gets a random layout
on the (2, 2) ``("dp", "tp")`` mesh: ``R``, ``S(d)`` for a dim whose size is a multiple of 4, or
``P`` (Partial sum). Makers are listed simplest first, so hypothesis shrinks toward plain ops.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from tests.property.chain_ir import SIZES, Builder, Chain, Draw, OpMaker, Ref, any_dim, partner, some_dims
from tests.property.chain_ops import advanced, attention, bmm, index, mm, norm, order, scatter, vector

UNARY = ("tanh", "sigmoid", "relu", "neg", "abs", "sin", "gelu", "silu", "clone", "hardtanh", "leaky_relu")


def unary(draw: Draw, b: Builder, x: Ref) -> Ref:
    """A pointwise unary op (activations, ``neg``, ``abs``, ``clone``, ...)."""
    name = draw(st.sampled_from(UNARY))
    bounded = name in ("tanh", "sigmoid", "sin", "hardtanh")
    return b.op(f"aten.{name}", (x,), 1.0 if bounded else x.mag, pos=name == "sigmoid")


def exp(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``exp`` (drawn only while the head is O(1), see :func:`applicable`)."""
    return b.op("aten.exp", (x,), 2.72**x.mag, pos=True)


def positive_only(draw: Draw, b: Builder, x: Ref) -> Ref:
    """Ops defined (and smooth) on positive inputs only; divisions get ``x + 1 >= 1``."""
    name = draw(st.sampled_from(["log", "sqrt", "rsqrt", "reciprocal", "div.Tensor"]))
    if name in ("log", "sqrt"):
        return b.op(f"aten.{name}", (x,), x.mag + 4.0, pos=name == "sqrt")
    y = b.op("aten.add.Scalar", (x, 1.0), x.mag + 1.0, pos=True)
    if name == "div.Tensor":
        z = partner(draw, b, x)
        return b.op("aten.div.Tensor", (z, y), z.mag)
    return b.op(f"aten.{name}", (y,), 1.0, pos=True)


def scalar(draw: Draw, b: Builder, x: Ref) -> Ref:
    """The head with a Python scalar: ``mul``/``add``/``div.Scalar``, a square, a ``clamp``."""
    name = draw(st.sampled_from(["mul.Scalar", "add.Scalar", "div.Scalar", "pow.Tensor_Scalar", "clamp"]))
    c = draw(st.sampled_from([0.5, -2.0, 3.0]))
    if name == "pow.Tensor_Scalar":
        return b.op("aten.pow.Tensor_Scalar", (x, 2), x.mag**2, pos=x.pos)
    if name == "clamp":
        return b.op("aten.clamp", (x, -0.5, 1.0), 1.0)
    mag = {"mul.Scalar": x.mag * abs(c), "add.Scalar": x.mag + abs(c), "div.Scalar": x.mag / abs(c)}[name]
    return b.op(f"aten.{name}", (x, c), mag, pos=x.pos and c > 0)


def binary(draw: Draw, b: Builder, x: Ref, *, fresh: bool = False) -> Ref:
    """A broadcasting binary op of the head and :func:`~tests.property.chain_ir.partner` (a fresh
    param when ``fresh``), in either order."""
    name = draw(st.sampled_from(["add.Tensor", "mul.Tensor", "sub.Tensor", "maximum", "minimum", "add-alpha"]))
    y = partner(draw, b, x, fresh=fresh)
    args = (x, y) if draw(st.booleans()) else (y, x)
    if name == "add-alpha":
        return b.op("aten.add.Tensor", args, x.mag + 2 * y.mag, kwargs={"alpha": draw(st.sampled_from([2, -0.5]))})
    mag = x.mag * y.mag if name == "mul.Tensor" else x.mag + y.mag
    return b.op(f"aten.{name}", args, mag, pos=x.pos and y.pos and name != "sub.Tensor")


def ternary(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``lerp.Scalar`` or ``addcmul`` of the head and broadcast-compatible partners."""
    y = partner(draw, b, x)
    if draw(st.booleans()):
        return b.op("aten.lerp.Scalar", (x, y, 0.25), max(x.mag, y.mag))
    z = partner(draw, b, y if y.rank > x.rank or y.meta.numel() > x.meta.numel() else x)
    return b.op("aten.addcmul", (x, y, z), x.mag + y.mag * z.mag, kwargs={"value": 0.5})


def where(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``where`` (two tensor branches, or one and a scalar) or ``masked_fill`` with a ``gt`` mask."""
    form = draw(st.sampled_from(["self", "ScalarOther", "ScalarSelf", "masked_fill"]))
    if form != "self":
        cond = b.op("aten.gt.Scalar", (x, 0.0), 1.0)
        if form == "ScalarOther":
            return b.op("aten.where.ScalarOther", (cond, x, 0.0), x.mag)
        if form == "ScalarSelf":
            return b.op("aten.where.ScalarSelf", (cond, -1.0, x), x.mag)
        return b.op("aten.masked_fill.Scalar", (x, cond, draw(st.sampled_from([0.0, -1.0]))), x.mag)
    y = partner(draw, b, x)
    cond = b.op("aten.gt.Scalar", (draw(st.sampled_from([x, y])), 0.0), 1.0)
    args = (cond, x, y) if draw(st.booleans()) else (cond, y, x)
    return b.op("aten.where.self", args, max(x.mag, y.mag))


def reduce(draw: Draw, b: Builder, x: Ref) -> Ref:
    """A reduction over some dims, with or without ``keepdim``: sum, mean, amax, amin, logsumexp, var."""
    name = draw(st.sampled_from(["sum.dim_IntList", "mean.dim", "amax", "amin", "logsumexp", "var.correction"]))
    dims = some_dims(draw, x)
    if draw(st.booleans()):
        dims = [d - x.rank for d in dims]
    keepdim = draw(st.booleans())
    n = 1
    for d in dims:
        n *= x.shape[d]
    if name == "var.correction":
        kwargs = {"correction": 1 if n > 1 else 0, "keepdim": keepdim}
        return b.op("aten.var.correction", (x, dims), x.mag**2, kwargs=kwargs)
    mag = x.mag * n**0.5 if name == "sum.dim_IntList" else x.mag + (3.0 if name == "logsumexp" else 0.0)
    return b.op(f"aten.{name}", (x, dims, keepdim), mag)


def reduce_all(draw: Draw, b: Builder, x: Ref) -> Ref:
    """A reduction over every dim (``sum``, ``mean``, ``max``); drawn as a chain's last op only."""
    name = draw(st.sampled_from(["sum", "mean", "max"]))
    return b.op(f"aten.{name}", (x,), x.mag * (x.meta.numel() ** 0.5 if name == "sum" else 1.0))


def scan(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``cumsum`` along a dim, or ``flip`` of it."""
    d = any_dim(draw, x)
    if draw(st.booleans()):
        return b.op("aten.cumsum", (x, d), x.mag * x.shape[d] ** 0.5)
    return b.op("aten.flip", (x, [d]), x.mag, pos=x.pos)


def like(draw: Draw, b: Builder, x: Ref) -> Ref:
    """The head combined with a created tensor: ``*_like``, ``new_*`` or ``arange``."""
    form = draw(st.sampled_from(["ones_like", "zeros_like", "full_like", "new_ones", *(["arange"] if x.rank else [])]))
    if form == "full_like":
        c = b.op("aten.full_like", (x, 0.5), 0.5, pos=True)
    elif form == "new_ones":
        c = b.op("aten.new_ones", (x, list(x.shape)), 1.0, pos=True)
    elif form == "arange":
        n = x.shape[-1]
        c = b.op("aten.arange.start_step", (0, n, 1), float(n), pos=False, kwargs={"dtype": torch.float32})
    else:
        c = b.op(f"aten.{form}", (x,), 1.0, pos=form == "ones_like")
    if draw(st.booleans()):
        return b.op("aten.mul.Tensor", (x, c), x.mag * c.mag)
    return b.op("aten.add.Tensor", (c, x), x.mag + c.mag)


def cast(draw: Draw, b: Builder, x: Ref) -> Ref:
    """A round trip through float64 with an op in between."""
    wide = b.op("aten._to_copy", (x,), x.mag, pos=x.pos, kwargs={"dtype": torch.float64})
    y = b.op("aten.tanh", (wide,), 1.0)
    return b.op("aten._to_copy", (y,), 1.0, kwargs={"dtype": torch.float32})


def reshape(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``view``/``reshape`` merging two adjacent dims, splitting one, or flattening."""
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
    return b.op(target, (x, new), x.mag, pos=x.pos)


def transpose(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``transpose``, ``permute`` or (2-D) ``t``."""
    form = draw(st.sampled_from(["transpose", "permute", "t"] if x.rank == 2 else ["transpose", "permute"]))
    if form == "t":
        return b.op("aten.t", (x,), x.mag, pos=x.pos)
    if form == "permute":
        return b.op("aten.permute", (x, draw(st.permutations(list(range(x.rank))))), x.mag, pos=x.pos)
    return b.op("aten.transpose.int", (x, any_dim(draw, x), any_dim(draw, x)), x.mag, pos=x.pos)


def unsqueeze(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``unsqueeze`` at any position."""
    return b.op("aten.unsqueeze", (x, draw(st.integers(0, x.rank))), x.mag, pos=x.pos)


def ones(draw: Draw, b: Builder, x: Ref) -> Ref:
    """Remove or widen size-1 dims: ``squeeze.dim``, ``squeeze``, or ``expand`` to a real size."""
    d = draw(st.sampled_from([d for d, s in enumerate(x.shape) if s == 1]))
    form = draw(st.sampled_from(["squeeze.dim", "expand", "squeeze"]))
    if form == "squeeze.dim":
        return b.op("aten.squeeze.dim", (x, d), x.mag, pos=x.pos)
    if form == "squeeze":
        return b.op("aten.squeeze", (x,), x.mag, pos=x.pos)
    sizes = [draw(st.sampled_from(SIZES)) if e == d else -1 for e in range(x.rank)]
    return b.op("aten.expand", (x, sizes), x.mag, pos=x.pos)


def softmax(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``_softmax`` or ``_log_softmax`` along a dim."""
    if draw(st.booleans()):
        return b.op("aten._softmax", (x, any_dim(draw, x), False), 1.0, pos=True)
    return b.op("aten._log_softmax", (x, any_dim(draw, x), False), x.mag + 3.0)


def join(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``cat`` or ``stack`` of the head with a fresh or earlier value."""
    dim = draw(st.integers(0, x.rank - 1))
    stack = draw(st.booleans())
    rest = x.shape if stack else x.shape[:dim] + x.shape[dim + 1 :]
    fits = [
        v for v in b.values if v.rank == x.rank and (v.shape if stack else v.shape[:dim] + v.shape[dim + 1 :]) == rest
    ]
    if b.room() and draw(st.booleans()):
        shape = list(x.shape)
        if not stack:
            shape[dim] = draw(st.sampled_from(SIZES))
        y = b.param(tuple(shape))
    else:
        y = draw(st.sampled_from(fits))
    args = [x, y] if draw(st.booleans()) else [y, x]
    if stack:
        return b.op("aten.stack", (args, dim), max(x.mag, y.mag))
    return b.op("aten.cat", (args, dim - x.rank if draw(st.booleans()) else dim), max(x.mag, y.mag))


def take(draw: Draw, b: Builder, x: Ref) -> Ref:
    """Part of the head: ``slice``, ``select``, a piece of ``split``, a constant pad, or ``repeat``."""
    dims = [d for d, s in enumerate(x.shape) if s >= 4]
    d = draw(st.sampled_from(dims))
    size = x.shape[d]
    form = draw(st.sampled_from(["slice", "select", "split", "pad", "repeat"]))
    if form == "slice":
        start = draw(st.sampled_from([0, size // 4, size // 2]))
        return b.op("aten.slice.Tensor", (x, d, start, size), x.mag, pos=x.pos)
    if form == "select":
        return b.op("aten.select.int", (x, d, draw(st.sampled_from([0, size - 1]))), x.mag, pos=x.pos)
    if form == "split":
        pieces = b.ops("aten.split.Tensor", (x, size // 2, d), x.mag, pos=x.pos, n=-(-size // (size // 2)))
        return pieces[draw(st.integers(0, 1))]
    if form == "pad":
        pad = [draw(st.sampled_from([0, 1, 4])) for _ in range(2 * min(x.rank, 2))]
        return b.op("aten.constant_pad_nd", (x, pad, draw(st.sampled_from([0.0, 1.0]))), max(x.mag, 1.0))
    reps = [draw(st.sampled_from([1, 2])) for _ in range(x.rank)]
    return b.op("aten.repeat", (x, reps), x.mag, pos=x.pos)


def applicable(x: Ref, *, last: bool) -> list[OpMaker]:
    """The makers that can take ``x`` as their head, simplest first (hypothesis shrinks toward the
    front); a maker listed twice is drawn more often."""
    out: list[OpMaker] = [unary, binary, scalar, like, cast, where, ternary, exp]
    if x.pos:
        out.append(positive_only)
    if x.rank >= 1:
        out += [reduce, reduce, transpose, softmax, join, reshape, scan, index, norm, order, scatter]
    if x.rank in (1, 2):
        # NOTE: x[i] has rank 2 * x.rank - 1; larger heads would grow the chain's tensors too fast.
        out.append(advanced)
    if x.rank in (3, 4):
        out.append(attention)
    if any(s >= 4 for s in x.shape):
        out.append(take)
    if x.rank < 3 or (x.rank < 4 and last):
        out.append(unsqueeze)
    if 1 in x.shape:
        out += [ones, ones]
    if x.rank == 1:
        out.append(vector)
    if x.rank == 2:
        out += [mm, mm, mm]
    if x.rank == 3:
        out += [bmm, bmm]
    if x.rank >= 1 and last:
        out.append(reduce_all)
    # NOTE: hypothesis draws the ends of a list more often than its middle; binary ops belong there.
    return [*out, binary]


def _layout(draw: Draw, shape: tuple[int, ...]) -> dict[str, str]:
    """A placement per mesh axis: R, S(d) for a dim whose size is a multiple of 4, or P."""
    dims = [d for d, s in enumerate(shape) if s % 4 == 0]
    options = ["R", *(f"S({d})" for d in dims), "P"]
    return {"dp": draw(st.sampled_from(options)), "tp": draw(st.sampled_from(options))}


@st.composite
def chains(draw: Draw, min_ops: int = 3, max_ops: int = 6) -> Chain:
    """A random :class:`Chain` of ``min_ops`` to ``max_ops`` drawn ops (plus the transposes, masks,
    indices and rescales some of them add) over 2 to 4 params."""
    b = Builder()
    rank = draw(st.sampled_from([2, 3, 1]))
    head = b.param(tuple(draw(st.sampled_from(SIZES)) for _ in range(rank)))
    n = draw(st.integers(min_ops, max_ops))
    for i in range(n):
        make = draw(st.sampled_from(applicable(head, last=i == n - 1)))
        head = make(draw, b, head)
    while len(b.params) < 2:
        head = binary(draw, b, head, fresh=True)
    layouts = {p.name: _layout(draw, p.shape) for p in b.params}
    return Chain(b.text(head), layouts, draw(st.integers(0, 2**31 - 1)))
