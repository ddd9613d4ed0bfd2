"""Op makers for the chain generator that need structured extra operands: matrices (``mm``, ``addmm``,
``bmm``, ``baddbmm``, ``mv``, ``dot``), computed integer indices (``max.dim``, ``gather``, ``argmax``,
``index_select``, ``embedding``, advanced indexing, ``scatter``), ``sort``/``topk``, normalizations and
attention. Each takes the chain's head and returns the new head (see :mod:`tests.property.chain_gen`).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from tests.property.chain_ir import SIZES, Builder, Draw, Ref, any_dim


def _matrix(draw: Draw, b: Builder, k: int, batch: tuple[int, ...], fallback: Ref) -> Ref:
    """A ``batch + (k, n)`` operand: an earlier value of that form, a fresh param, or ``fallback``."""
    known = [v for v in b.values if v.rank == len(batch) + 2 and v.shape[: len(batch) + 1] == (*batch, k)]
    choices = [*(["known"] if known else []), *(["fresh"] if b.room() else [])] or ["fallback"]
    how = draw(st.sampled_from(choices))
    if how == "known":
        return draw(st.sampled_from(known))
    if how == "fresh":
        return b.param((*batch, k, draw(st.sampled_from(SIZES))))
    return fallback


def mm(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``mm`` with the 2-D head on either side, or ``addmm`` with a fresh 1-D or 2-D bias."""
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


def bmm(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``bmm`` of the 3-D head, or ``baddbmm`` with a fresh bias."""
    bs, m, k = x.shape
    w = _matrix(draw, b, k, (bs,), x)
    if w is x:
        w = b.op("aten.transpose.int", (w, 1, 2), w.mag)
    if draw(st.booleans()) and b.room():
        bias = b.param((m, w.shape[2]) if draw(st.booleans()) else (bs, m, w.shape[2]))
        return b.op("aten.baddbmm", (bias, x, w), x.mag * w.mag * k**0.5 + 1.0)
    return b.op("aten.bmm", (x, w), x.mag * w.mag * k**0.5)


def _like(draw: Draw, b: Builder, x: Ref) -> Ref:
    """A value of exactly ``x``'s shape: a fresh param, an earlier value, or ``x`` itself."""
    known = [v for v in b.values if v.shape == x.shape]
    if b.room() and draw(st.booleans()):
        return b.param(x.shape)
    return draw(st.sampled_from(known))


def vector(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``dot`` of the 1-D head with a vector of its length, or ``mv`` of a matrix with it."""
    (k,) = x.shape
    if draw(st.booleans()):
        y = _like(draw, b, x)
        return b.op("aten.dot", (x, y), x.mag * y.mag * k**0.5)
    w = _matrix(draw, b, k, (), x)
    w = b.op("aten.t", (w,), w.mag) if w.rank == 2 else b.op("aten.unsqueeze", (x, 0), x.mag)
    return b.op("aten.mv", (w, x), x.mag * w.mag * k**0.5)


def index(draw: Draw, b: Builder, x: Ref) -> Ref:
    """Ops with computed integer indices: ``max.dim``'s values, or its indices into ``gather``; the
    ``argmax`` over a dim into ``index_select`` along it or into an ``embedding`` table that long."""
    d = draw(st.integers(0, x.rank - 1))
    forms = ["max.dim", "gather", *(["index_select"] if x.rank == 2 else []), *(["embedding"] if b.room() else [])]
    form = draw(st.sampled_from(forms))
    if form in ("max.dim", "gather"):
        values, idx = b.ops("aten.max.dim", (x, d, True), x.mag, n=2)
        return values if form == "max.dim" else b.op("aten.gather", (x, d, idx), x.mag)
    # NOTE: argmax over dim d gives positions < x.shape[d]: valid indices along d, or rows of a table.
    idx = b.op("aten.argmax", (x, d), 1.0)
    if form == "index_select":
        return b.op("aten.index_select", (x, d, idx), x.mag)
    table = b.param((x.shape[d], draw(st.sampled_from(SIZES))))
    return b.op("aten.embedding", (table, idx), table.mag)


def order(draw: Draw, b: Builder, x: Ref) -> Ref:
    """Values of ``topk`` or ``sort`` along a dim (ties give equal values in any order)."""
    d = any_dim(draw, x)
    if draw(st.booleans()):
        values, _ = b.ops("aten.sort", (x, d, draw(st.booleans())), x.mag, pos=x.pos, n=2)
        return values
    k = draw(st.integers(1, x.shape[d]))
    values, _ = b.ops("aten.topk", (x, k, d), x.mag, pos=x.pos, n=2)
    return values


def scatter(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``scatter_add`` / ``scatter.value`` at the positions of ``max.dim`` along a dim."""
    d = draw(st.integers(0, x.rank - 1))
    values, idx = b.ops("aten.max.dim", (x, d, True), x.mag, n=2)
    if draw(st.booleans()):
        return b.op("aten.scatter_add", (x, d, idx, values), 2 * x.mag)
    return b.op("aten.scatter.value", (x, d, idx, draw(st.sampled_from([0.0, 2.0]))), max(x.mag, 2.0))


def advanced(draw: Draw, b: Builder, x: Ref) -> Ref:
    """Advanced indexing ``x[i]`` / ``x[:, i]`` with ``argmax`` positions, or ``index_put`` of the
    picked rows back with ``accumulate``."""
    d = draw(st.integers(0, min(x.rank, 2) - 1))
    idx = b.op("aten.argmax", (x, d), 1.0)
    indices = [idx] if d == 0 else [None, idx]
    picked = b.op("aten.index.Tensor", (x, indices), x.mag)
    if d == 0 and draw(st.booleans()):
        return b.op("aten.index_put", (x, indices, picked, True), 2 * x.mag)
    return picked


def norm(draw: Draw, b: Builder, x: Ref) -> Ref:
    """``native_layer_norm`` / ``_fused_rms_norm`` over the last dim, with fresh affine params."""
    h = x.shape[-1]
    w = b.param((h,)) if b.room() and draw(st.booleans()) else None
    if draw(st.booleans()):
        bias = b.param((h,)) if b.room() and draw(st.booleans()) else None
        out = b.ops("aten.native_layer_norm", (x, [h], w, bias, 1e-5), 2.0, n=3)
    else:
        out = b.ops("aten._fused_rms_norm", (x, [h], w, 1e-5), 2.0, n=2)
    return out[0]


def attention(draw: Draw, b: Builder, x: Ref) -> Ref:
    """CPU flash or math attention with the head as the query ``[B, H, L, E]`` (a 3-D head gets a
    heads dim of 1) and keys/values ``[B, H, S, E]``, fresh or earlier values."""
    q = x if x.rank == 4 else b.op("aten.unsqueeze", (x, 1), x.mag, pos=x.pos)
    bs, h, _, e = q.shape
    known = [v for v in b.values if v.rank == 4 and v.shape[:2] == (bs, h) and v.shape[3] == e]
    size = draw(st.sampled_from(SIZES))
    kv = [draw(st.sampled_from(known)) if known and not (b.room() and draw(st.booleans())) else None for _ in "kv"]
    k, v = (w if w is not None else b.param((bs, h, size, e)) if b.room() else q for w in kv)
    if k.shape[2] != v.shape[2]:
        v = k
    target = draw(
        st.sampled_from(["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math"])
    )
    if target.startswith("_scaled_dot_product_flash"):
        # NOTE: the CPU flash kernel reads garbage unless the last dim has stride 1 (the public SDPA
        # checks this before choosing it); a captured graph only ever calls it on such inputs.
        q, k, v = (_last_dim_contiguous(b, t) for t in (q, k, v))
    out, _ = b.ops(f"aten.{target}", (q, k, v), v.mag, n=2)
    return out


def _last_dim_contiguous(b: Builder, x: Ref) -> Ref:
    if x.meta.stride(-1) == 1:
        return x
    return b.op("aten.clone", (x,), x.mag, pos=x.pos, kwargs={"memory_format": torch.contiguous_format})
