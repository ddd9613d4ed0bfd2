"""Ring attention as steps: the ops a sequence-split attention becomes when its point-to-point
passes are ops of the program (``passes/cp/steps.py``), so the overlap pass schedules them.

A value split along a dim over a mesh axis of ``n`` ranks is cut in pieces, ``k`` per rank (rank
``r`` holds pieces ``r*k .. r*k+k-1`` of the whole, in order). ``comm.ppermute`` moves pieces
between ranks: its result's piece ``j`` is the operand's piece ``order[j]``; ``permuted`` is that on
the whole tensor, which is what the op means on global values (a reference run of a compiled graph
on whole tensors, ``parallelize(verify=True)``). Two orders serve the ring:

* ``shift_order(n)``: rank ``r`` receives what rank ``r - 1`` holds; after ``s`` of them rank ``r``
  holds the keys and values of rank ``r - s``;
* ``zigzag_order(n)``: from the contiguous split (rank ``r`` holds half-chunks ``2r`` and ``2r+1``
  of ``2n``) to the balanced one: rank ``r`` holds half-chunks ``r`` and ``2n-1-r``, the even one
  first (``held``). Under a causal mask each rank then has the same work at every step.

``ring_step(q, k, v, rank, size, step, causal, zigzag, scale, qstep) -> (out, lse)``: the blocks
rank ``rank`` of ``size`` computes when it holds the queries of rank ``rank - qstep`` (its own under
ring attention; another's under TokenRing, ``qstep = s`` at step ``s``, its own keys ``step = 0``)
and the keys and values of rank ``rank - step`` (ring attention's step ``step``): each held query
chunk against each held key chunk that comes before it (whole),
is it (causal), or any of them without a causal mask; merged within the step by log-sum-exp, a row
no block reached has output 0 and log-sum-exp ``-inf``. ``lse_merge`` merges two steps' results.
``ring_step_backward(grad, q, k, v, out, lse, ...) -> (dq, dk, dv)``: the same blocks' gradients
from the merged output and log-sum-exp; ``dk``/``dv`` are those of the held keys and values (their
owner's, once passed home). Keys and values may have fewer heads than the queries (grouped-query
attention). ``rank = -1`` runs every rank's part of whole tensors and joins them (the global
meaning); a backend passes the rank's own coordinate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

aten = torch.ops.aten


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, o: torch.Tensor, lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax-normalised partial outputs over disjoint keys, merged by their log-sum-exps."""
    if out is None or lse is None:
        return o, lo
    new = torch.logaddexp(lse, lo)
    at = torch.where(torch.isneginf(new), 0.0, new)  # NOTE: rows no key has reached yet stay 0
    return out * torch.exp(lse - at).unsqueeze(-1) + o * torch.exp(lo - at).unsqueeze(-1), new


def repeated(x: torch.Tensor, times: int) -> torch.Tensor:
    """Grouped-query keys or values, each head repeated for the query heads that read it."""
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def summed(g: torch.Tensor, times: int) -> torch.Tensor:
    """The gradient of ``repeated``: each head's repeats summed."""
    if times == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // times, times, s, d).sum(2)


def permuted(x: torch.Tensor, dim: int, order: Sequence[int]) -> torch.Tensor:
    """``x`` cut in ``len(order)`` pieces along ``dim``, piece ``j`` of the result ``order[j]`` of ``x``."""
    pieces = x.chunk(len(order), dim)
    return torch.cat([pieces[i] for i in order], dim)


def shift_order(n: int, by: int = 1) -> tuple[int, ...]:
    """Rank ``r`` receives the piece of rank ``r - by``."""
    return tuple((r - by) % n for r in range(n))


def held(rank: int, n: int, zigzag: bool) -> tuple[int, ...]:
    """The chunks of the sequence ``rank`` holds (of ``2n`` half-chunks when ``zigzag``, else of ``n``),
    in its local order."""
    return tuple(sorted((rank, 2 * n - 1 - rank), key=lambda h: h % 2)) if zigzag else (rank,)


def zigzag_order(n: int) -> tuple[int, ...]:
    """From the contiguous split to the zigzag one (``held``), in half-chunks."""
    return tuple(h for r in range(n) for h in held(r, n, True))


def inverse(order: Sequence[int]) -> tuple[int, ...]:
    out = [0] * len(order)
    for j, i in enumerate(order):
        out[i] = j
    return tuple(out)


def pairs(mine: Sequence[int], theirs: Sequence[int], causal: bool) -> list[tuple[int, int, bool]]:
    """``(query chunk, key chunk, causal)`` (indices into ``mine`` and ``theirs``, chunks of the
    sequence) of the blocks queries in ``mine`` attend to keys in ``theirs``: every pair without a
    causal mask; with one, a key chunk before the query chunk whole, the same chunk causal."""
    out = []
    for qi, a in enumerate(mine):
        for ki, b in enumerate(theirs):
            if not causal or b < a:
                out.append((qi, ki, False))
            elif b == a:
                out.append((qi, ki, True))
    return out


def blocks(rank: int, n: int, step: int, causal: bool, zigzag: bool, qstep: int = 0) -> list[tuple[int, int, bool]]:
    """``(query chunk, key chunk, causal)`` (local indices) of the blocks ``ring_step`` computes."""
    return pairs(held((rank - qstep) % n, n, zigzag), held((rank - step) % n, n, zigzag), causal)


def step_area(n: int, step: int, causal: bool, zigzag: bool, qstep: int = 0) -> float:
    """The share of the whole ``L x L`` score matrix all ranks' blocks of one step cover (a causal block
    counts half)."""
    per = 1.0 / (n * (2 if zigzag else 1)) ** 2
    pairs = (blocks(r, n, step, causal, zigzag, qstep) for r in range(n))
    return sum(per * (0.5 if c else 1.0) for b in pairs for _, _, c in b)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _each_rank(
    fn: Callable[..., tuple[torch.Tensor, ...]], xs: Sequence[torch.Tensor], size: int
) -> tuple[torch.Tensor, ...]:
    """``fn(r, *pieces)`` for every rank ``r`` on its pieces (dim 2) of whole tensors, joined."""
    parts = [x.chunk(size, 2) for x in xs]
    outs = [fn(r, *(p[r] for p in parts)) for r in range(size)]
    return tuple(torch.cat(list(col), 2) for col in zip(*outs, strict=True))


def _forward(
    xs: Sequence[torch.Tensor],
    rank: int,
    size: int,
    step: int,
    causal: bool,
    zigzag: bool,
    scale: float | None,
    qstep: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ring_step`` on one rank: ``xs`` is ``(q, k, v)``."""
    q, k, v = xs
    n, times = 2 if zigzag else 1, q.shape[1] // k.shape[1]
    qs, ks, vs = q.chunk(n, 2), repeated(k, times).chunk(n, 2), repeated(v, times).chunk(n, 2)
    got: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * n
    for qi, ki, c in blocks(rank, size, step, causal, zigzag, qstep):
        o, lo, *_ = aten._scaled_dot_product_flash_attention_for_cpu(qs[qi], ks[ki], vs[ki], 0.0, c, scale=scale)
        got[qi] = merge(*got[qi], o, lo)
    outs, lses = [], []
    for qi, (o, lo) in enumerate(got):
        outs.append(torch.zeros_like(qs[qi]) if o is None else o)
        lses.append(qs[qi].new_full(qs[qi].shape[:-1], -math.inf, dtype=_lse_dtype(q)) if lo is None else lo)
    return torch.cat(outs, 2), torch.cat(lses, 2)


@torch.library.custom_op("meshfold::ring_step", mutates_args=())
def ring_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rank: int,
    size: int,
    step: int,
    causal: bool,
    zigzag: bool,
    scale: float | None = None,
    qstep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module doc."""
    how = (size, step, causal, zigzag, scale, qstep)
    if rank >= 0:
        return _forward((q, k, v), rank, *how)
    out, lse = _each_rank(lambda r, *xs: _forward(xs, r, *how), (q, k, v), size)
    return out, lse


@ring_step.register_fake
def _(q, k, v, rank, size, step, causal, zigzag, scale=None, qstep=0):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


def _backward(
    xs: Sequence[torch.Tensor],
    rank: int,
    size: int,
    step: int,
    causal: bool,
    zigzag: bool,
    scale: float | None,
    qstep: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ring_step_backward`` on one rank: ``xs`` is ``(grad, q, k, v, out, lse)``."""
    grad, q, k, v, out, lse = xs
    n, times = 2 if zigzag else 1, q.shape[1] // k.shape[1]
    gs, qs, os_, ls = (x.chunk(n, 2) for x in (grad.contiguous(), q, out, lse))
    ks, vs = repeated(k, times).chunk(n, 2), repeated(v, times).chunk(n, 2)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dqs, dks, dvs = dq.chunk(n, 2), dk.chunk(n, 2), dv.chunk(n, 2)
    for qi, ki, c in blocks(rank, size, step, causal, zigzag, qstep):
        gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            gs[qi], qs[qi], ks[ki], vs[ki], os_[qi], ls[qi], 0.0, c, scale=scale
        )
        dqs[qi].add_(gq)
        dks[ki].add_(summed(gk, times))
        dvs[ki].add_(summed(gv, times))
    return dq, dk, dv


@torch.library.custom_op("meshfold::ring_step_backward", mutates_args=())
def ring_step_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rank: int,
    size: int,
    step: int,
    causal: bool,
    zigzag: bool,
    scale: float | None = None,
    qstep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module doc."""
    how = (size, step, causal, zigzag, scale, qstep)
    if rank >= 0:
        return _backward((grad, q, k, v, out, lse), rank, *how)
    dq, dk, dv = _each_rank(lambda r, *xs: _backward(xs, r, *how), (grad, q, k, v, out, lse), size)
    return dq, dk, dv


@ring_step_backward.register_fake
def _(grad, q, k, v, out, lse, rank, size, step, causal, zigzag, scale=None, qstep=0):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("meshfold::lse_merge", mutates_args=())
def lse_merge(
    out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two results over disjoint keys merged by their log-sum-exps (``merge``)."""
    return merge(out, lse, o, lo)


@lse_merge.register_fake
def _(out, lse, o, lo):  # type: ignore[no-untyped-def]
    return torch.empty_like(out), torch.empty_like(lse)


RING_STEP = torch.ops.meshfold.ring_step.default
RING_STEP_BACKWARD = torch.ops.meshfold.ring_step_backward.default
LSE_MERGE = torch.ops.meshfold.lse_merge.default
RANK_ARG = {RING_STEP: 3, RING_STEP_BACKWARD: 6}
"""The ops whose ``rank`` argument (at this index) a backend fills with the rank's coordinate."""


def first_step(op: object) -> bool:
    """Whether ``op`` (an IR op) is the first step of an attention written as steps: ``ring_step`` on
    the rank's own queries and keys (one per attention, as the kernel it replaced)."""
    args: Sequence[object] = getattr(op, "args", ())
    if getattr(op, "target", None) != RING_STEP:
        return False
    return args[5] == 0 and (len(args) < 10 or args[9] == 0)
