"""What a routed-experts op (``ir.dialects.moe``) holds on one rank while it runs, and the pieces it computes
in: the liveness estimate (``passes.cost.liveness``) holds its working set while it runs, and a
memory budget (``passes.memory.budget``) may ask it for smaller pieces."""

from __future__ import annotations

import math
from typing import NamedTuple

from meshfold.ir.dialects.moe import EXPERTS, TOKENS_AND_WEIGHTS, exchange_axes, piece_rows
from meshfold.ir.graph import Op, local_nbytes
from meshfold.ir.mesh import Mesh
from meshfold.ir.symbolic import size_hint


def working_set(op: Op, mesh: Mesh) -> int:
    """Bytes a routed-experts op holds on one rank while it runs, beyond its operands and results,
    with the tokens spread evenly over the experts. Computed in place (``experts_range``): its pairs'
    indices and weights, and one piece (``piece_rows`` pairs) of one expert's temporaries. Over
    exchange axes (``backends/experts/dispatch.py``), the largest of its phases: sending the pairs' rows, computing
    on what arrived, sending the results back, combining. Both measured against the allocator's peak
    (``tests/unit/test_moe_ops.py``, ``tests/dist/test_moe_dispatch.py``)."""
    sh = _share(op, mesh)
    h, i, s, pairs = sh.hidden, sh.intermediate, sh.itemsize, sh.pairs
    rows = min(piece_rows(op), sh.per_expert)
    # NOTE: an expert's row list and one piece's; one piece of one expert's temporaries
    per = 8 * sh.per_expert + 8 * rows
    if op.target == EXPERTS:
        piece = s * rows * h + max(3 * s * rows * i, s * rows * (i + h), 2 * s * rows * h)
    else:
        piece = s * rows * (7 * h + 7 * i)
    if sh.ranks == 1:
        # NOTE: tok, slot, local (int64) and each pair's weight (and, backward, its weight's gradient)
        ind = 3 * 8 * pairs + s * pairs * (1 if op.target == EXPERTS else 2)
        return ind + per + piece
    return _exchanged(op, sh, per + piece, mesh)


def _exchanged(op: Op, sh: _Share, compute: int, mesh: Mesh) -> int:
    """``working_set`` of the all-to-all lowering: the peak of its phases less its results. ``P``
    pairs leave and (evenly spread) as many arrive; each travels as one row of floats (the token,
    with its incoming gradient in the backward, and its weight) and of int64s (expert, position)."""
    h, s, p, t, k = sh.hidden, sh.itemsize, sh.pairs, sh.tokens, sh.k
    results = sum(local_nbytes(r, mesh) for r in op.results)
    width = h + 1 if op.target == EXPERTS else 2 * h + 1
    # NOTE: kept to the end: tok, slot, the hop's order and each arrived pair's local expert
    ids = 32 * p
    # NOTE: sending: the rows (backward: the tokens with their gradients, cat first), owner per pair
    # and pair lists, the sorted copy and what arrived, the int64 rows and destinations
    send = (0 if op.target == EXPERTS else 2 * t * h * s) + 8 * t * k + 72 * p + 3 * p * width * s
    arrived = p * width * s
    if op.target == EXPERTS:
        weights = 0
        made = p * h * s  # NOTE: each pair's output
    else:
        weights = results - t * h * s - t * k * s  # NOTE: the expert weights' gradients, made first
        made = p * (h + 1) * s  # NOTE: each pair's d_x and d_weight
    computing = arrived + made + ids + compute + weights
    # NOTE: the results travel back (backward: d_x and d_weight as one row, cat first) into a sorted
    # copy; the forward has made its output (zeros, then the combine adds into it) before they do
    back = arrived + ids + (3 * made + results if op.target == EXPERTS else 4 * made + weights)
    ending = arrived + 2 * made + ids + results
    return max(send, computing, back, ending) - results


def pieces(op: Op, mesh: Mesh, rows: int | None = None) -> int:
    """Pieces a routed-experts op computes on one rank, ``rows`` pairs each (None: its own
    ``piece_rows``), with the tokens spread evenly over the experts."""
    share = _share(op, mesh)
    return share.experts * math.ceil(share.per_expert / (rows or piece_rows(op)))


class _Share(NamedTuple):
    """One rank's share of a routed-experts op."""

    tokens: int
    k: int
    hidden: int
    intermediate: int
    itemsize: int
    ranks: int
    """Ranks it exchanges tokens with (1: none)."""
    experts: int
    pairs: int
    per_expert: int


def _share(op: Op, mesh: Mesh) -> _Share:
    tokens_at, weights_at = TOKENS_AND_WEIGHTS[op.target]
    hidden, idx, w_down = op.operands[tokens_at], op.operands[tokens_at + 1], op.operands[weights_at + 1]
    shapes = [v.layout.local_shape(v.type.shape, mesh) for v in (hidden, idx, w_down)]  # type: ignore[union-attr]
    (t, h), (_, k), (mine, _, i) = ([int(size_hint(d)) for d in s] for s in shapes)
    experts = int(size_hint(w_down.type.shape[0]))  # type: ignore[union-attr]
    n = math.prod(mesh.size(a) for a in exchange_axes(op))
    pairs = math.ceil(t * k * mine / experts) * n
    s = hidden.type.dtype.itemsize  # type: ignore[union-attr]
    return _Share(t, k, h, i, s, n, mine, pairs, math.ceil(pairs / max(mine, 1)))
