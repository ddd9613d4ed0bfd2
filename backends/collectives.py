"""Lowering of ``comm.*`` ops to ``torch.ops._c10d_functional`` collectives, in two halves.

A functional collective returns at once with the result not yet written; ``wait_tensor`` blocks
until it is. Each comm op is lowered as :func:`issue` (the layout work before the call, and the
call) and :class:`Issued.finish` (``wait_tensor``, then the layout work after it: moving a dim back,
cutting a bucket apart, dividing an average). A collective that runs synchronously is both halves
back to back; a started one (``ir.asynchrony``) issues where its start is and finishes where its
``comm.wait`` is, so what lies between runs while the collective is on the wire (gloo runs it on a
worker thread; NCCL on its stream).

On gloo, sum reduce-scatters and all-gathers are sent as all-to-alls (:func:`by_all_to_all`).
gloo's all-to-all sends each peer its block directly; its reduce-scatter costs about as much as an
all-reduce of the whole operand. ``python -m meshfold.tools.bench.gloo_collectives`` (4 ranks on
2 cores, groups of 2): a reduce-scatter of 1-16 MiB per rank takes 1.4-1.7x the time and 1.5-1.8x
the CPU (all ranks' processes) that the all-to-all and the sum of what arrives take. Ranks sharing
a host's cores spend that CPU out of their compute. An all-gather sent so (its operand repeated
once per rank) costs about what gloo's own does (0.7-1.0x the CPU, the repeat included), but its
buffers are the program's, held to the wait, where gloo's own frees its flat buffer whenever the
transfer ends; a whole training step of 4 ranks measured 2% faster with it.
"""

from __future__ import annotations

import contextvars
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from meshfold.backends.wire import as_bytes, as_complex, as_real, complex_operands, float8_operands, from_bytes
from meshfold.ir import Mesh, Op, OpDef, TensorType
from meshfold.ir.ops import (
    ALL_GATHER,
    ALL_GATHER_BUCKET,
    ALL_REDUCE,
    ALL_REDUCE_BUCKET,
    ALL_TO_ALL,
    PARTIAL,
    PPERMUTE,
    REDUCE_SCATTER,
    REDUCE_SCATTER_BUCKET,
    SHARD,
)

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

Finish = Callable[[fx.Graph, fx.Node], list[fx.Node]]


@dataclass(frozen=True)
class Issued:
    """A lowered comm op after its call: ``node`` the collective's (not yet waited) result, None
    when the op moves nothing between ranks (its ``results`` are ready); ``finish`` what to emit
    after ``wait_tensor(node)``."""

    node: fx.Node | None
    finish: Finish | None = None
    results: tuple[fx.Node, ...] = ()
    wait: Callable[..., object] = c10d.wait_tensor.default
    """What blocks until ``node`` is written (a reload from the host tier has its own)."""

    def complete(self, g: fx.Graph) -> list[fx.Node]:
        """The op's results: wait for the collective and finish, or the ready results."""
        if self.node is None or self.finish is None:
            return list(self.results)
        return self.finish(g, g.call_function(self.wait, (self.node,)))


def issue(
    g: fx.Graph,
    op: Op,
    xs: list[fx.Node],
    size: int,
    group: str,
    coord: int,
    local: list[list[int]],
    gloo: bool = False,
) -> Issued:
    """Emit ``op``'s collective call on ``xs`` (this rank's operands) over a group of ``size`` ranks in
    which this rank is ``coord``; ``local``: each operand's local shape (buckets cut by it).

    ``gloo``: the group is gloo's. An all-gather is then sent as an all-to-all of its operand
    repeated once per rank, and a sum reduce-scatter as an all-to-all of its operand's blocks, the
    blocks that arrive summed after the wait (the module docstring says why). The buffers are the
    program's, held to the wait (gloo's own all-gather would gather into a flat buffer and free it
    when the transfer ends, at no fixed point of the program).

    Complex operands cross as real views, and a reduction that means nothing on an operand's dtype
    raises ``ValueError`` before anything is emitted (``backends/wire.py``)."""
    target = op.target
    assert isinstance(target, OpDef)
    which = complex_operands(op)
    if size == 1:
        return Issued(None, results=tuple(xs))  # NOTE: every layout change on a one-rank axis is the identity
    if target in (SHARD, PARTIAL):  # NOTE: those two stay on this rank: any dtype
        return _issued(g, op, xs, size, group, coord, local, gloo)
    bytes8 = float8_operands(op)
    if any(bytes8):
        dtypes = [v.type.dtype if b else None for v, b in zip(op.operands, bytes8, strict=True)]  # type: ignore[union-attr]
        inner = _issued(g, op, as_bytes(g, xs, bytes8), size, group, coord, local, gloo)
        done = inner.finish
        assert done is not None
        return replace(inner, finish=lambda g, out: from_bytes(g, done(g, out), dtypes))
    if not any(which):
        return _issued(g, op, xs, size, group, coord, local, gloo)
    real, sent = as_real(g, xs, local, which)
    inner = _issued(g, op, real, size, group, coord, sent, gloo)
    finish = inner.finish
    assert finish is not None
    return replace(inner, finish=lambda g, out: as_complex(g, finish(g, out), which))


def _issued(
    g: fx.Graph, op: Op, xs: list[fx.Node], size: int, group: str, coord: int, local: list[list[int]], gloo: bool
) -> Issued:
    """:func:`issue` on operands of real (or integer, or bool) dtypes, over at least two ranks."""
    target = op.target
    assert isinstance(target, OpDef)
    if target in (ALL_GATHER_BUCKET, REDUCE_SCATTER_BUCKET):
        return _bucket(g, op, xs, size, group, local, gloo)
    if target == ALL_REDUCE_BUCKET:
        return _reduce_bucket(g, op, xs, size, group, local)
    (x,) = xs
    if target == ALL_GATHER:
        dim = int(op.kwarg("dim"))
        front = to_front(g, x, dim)

        def gathered(g: fx.Graph, out: fx.Node) -> list[fx.Node]:
            return [from_front(g, out, dim)]

        if gloo:
            return _gather_by_all_to_all(g, front, len(local[0]), local[0][dim], size, group, gathered)
        return Issued(g.call_function(c10d.all_gather_into_tensor.default, (front, size, group)), gathered)
    if target == ALL_REDUCE:
        reduce = str(op.kwarg("reduce"))
        call = g.call_function(c10d.all_reduce.default, (x, "sum" if reduce == "avg" else reduce, group))
        return Issued(call, lambda g, out: [_averaged(g, out, size, reduce)])
    if target == REDUCE_SCATTER:
        dim = int(op.kwarg("dim"))
        reduce = str(op.kwarg("reduce"))
        if reduce == "max":
            call = g.call_function(c10d.all_reduce.default, (x, "max", group))
            return Issued(call, lambda g, out: [chunk(g, out, dim, size, coord)])
        front = to_front(g, x, dim)

        def scattered(g: fx.Graph, out: fx.Node) -> list[fx.Node]:
            return [_averaged(g, from_front(g, out, dim), size, reduce)]

        if gloo:
            rows = [size, local[0][dim] // size, *local[0][:dim], *local[0][dim + 1 :]]
            return _scatter_by_all_to_all(g, front, rows, group, scattered)
        return Issued(g.call_function(c10d.reduce_scatter_tensor.default, (front, "sum", size, group)), scattered)
    if target == ALL_TO_ALL:
        concat, split = int(op.kwarg("concat_dim")), int(op.kwarg("split_dim"))
        if concat == split:  # NOTE: gathered then cut on the same dim: a gather and this rank's chunk
            call = g.call_function(c10d.all_gather_into_tensor.default, (to_front(g, x, concat), size, group))
            return Issued(call, lambda g, out: [chunk(g, from_front(g, out, concat), split, size, coord)])
        # NOTE: the split dim in front, cut in ``size`` equal rows: row block j goes to rank j, and
        # what arrives (one block per rank, in rank order) is laid side by side along the concat dim
        rows = [local[0][split] // size] * size
        call = g.call_function(c10d.all_to_all_single.default, (to_front(g, x, split), rows, rows, group))
        return Issued(call, lambda g, out: [_side_by_side(g, out, size, split, concat, local[0])])
    if target == PPERMUTE:
        return _permute(g, x, int(op.kwarg("dim")), tuple(op.kwarg("order")), size, coord, group, local[0])  # type: ignore[arg-type]
    if target == SHARD:
        return Issued(None, results=(chunk(g, x, int(op.kwarg("dim")), size, coord),))
    if target == PARTIAL:
        if str(op.kwarg("reduce")) == "sum" and coord != 0:
            return Issued(None, results=(g.call_function(aten.zeros_like.default, (x,)),))
        return Issued(None, results=(x,))
    raise ValueError(f"{op.describe()}: no eager lowering for {op.name}")


BY_ALL_TO_ALL = "meshfold::{} by all_to_all over {} ranks"
"""The profiler's label (``record_function``) around the all-to-all call of a gloo all-gather or
reduce-scatter (the kind, the group's size)."""

_SENDING: contextvars.ContextVar[str | None] = contextvars.ContextVar("sent_by_all_to_all", default=None)


def by_all_to_all(kind: str, sent: torch.Tensor, rows: int, size: int, group: str) -> torch.Tensor:
    """The all-to-all a gloo collective of ``kind`` (``all_gather``, ``reduce_scatter``) is sent as
    (``issue``'s ``gloo``): ``sent``'s ``size`` blocks of ``rows`` leading rows, block ``j`` to rank
    ``j``; labelled for the profiler and for :func:`sent_by_all_to_all` as the collective it is."""
    token = _SENDING.set(kind)
    try:
        with torch.profiler.record_function(BY_ALL_TO_ALL.format(kind, size)):
            return c10d.all_to_all_single.default(sent, [rows] * size, [rows] * size, group)
    finally:
        _SENDING.reset(token)


def gather_by_all_to_all(sent: torch.Tensor, rows: int, size: int, group: str) -> torch.Tensor:
    """An all-gather on gloo: ``sent`` is its operand (``rows`` leading rows) repeated ``size`` times."""
    return by_all_to_all("all_gather", sent, rows, size, group)


def scatter_by_all_to_all(sent: torch.Tensor, rows: int, size: int, group: str) -> torch.Tensor:
    """A sum reduce-scatter on gloo: ``sent`` is its operand, block ``j`` rank ``j``'s to sum."""
    return by_all_to_all("reduce_scatter", sent, rows, size, group)


def sent_by_all_to_all() -> str | None:
    """The kind of collective (``all_gather``, ``reduce_scatter``) the all-to-all being dispatched
    now is sent for, or None (what a recorder of collectives should count it as)."""
    return _SENDING.get()


def _gather_by_all_to_all(
    g: fx.Graph, front: fx.Node, ndim: int, rows: int, size: int, group: str, then: Finish
) -> Issued:
    """``front`` (``ndim`` dims, the gathered one leading, ``rows`` long) all-gathered over gloo
    (``issue``'s ``gloo``): repeated once per rank and sent as an all-to-all; ``then`` finishes what
    arrives, in rank order."""
    sent = g.call_function(aten.repeat.default, (front, [size] + [1] * (ndim - 1)))
    call = g.call_function(gather_by_all_to_all, (sent, rows, size, group))
    return Issued(call, lambda g, out: then(g, g.call_function(_kept, (out, sent, front))))


def _scatter_by_all_to_all(g: fx.Graph, front: fx.Node, rows: list[int], group: str, then: Finish) -> Issued:
    """A sum reduce-scatter of ``front`` over gloo (``issue``'s ``gloo``): its ``rows[0]`` blocks of
    ``rows[1]`` leading rows sent as an all-to-all, block ``j`` to rank ``j``; what arrives (one block
    per rank, in rank order, each ``rows[1:]``) is summed; ``then`` finishes the sum."""
    call = g.call_function(scatter_by_all_to_all, (front, rows[1], rows[0], group))

    def summed(g: fx.Graph, out: fx.Node) -> list[fx.Node]:
        blocks = g.call_function(aten.view.default, (g.call_function(_kept, (out, front)), rows))
        return then(g, g.call_function(_block_sum, (blocks,)))

    return Issued(call, summed)


def _block_sum(blocks: torch.Tensor) -> torch.Tensor:
    """The sum of ``blocks`` over their leading dim, in their dtype (``torch.sum`` sums integers to int64)."""
    return blocks.sum(0, dtype=blocks.dtype)


def _kept(x: torch.Tensor, *held: torch.Tensor) -> torch.Tensor:
    """``x``; the program holds ``held`` up to here (fx frees a value after its last reader)."""
    return x


def _side_by_side(g: fx.Graph, arrived: fx.Node, n: int, split: int, concat: int, shape: list[int]) -> fx.Node:
    """An all-to-all's result from what arrived (``to_front(x, split)``'s layout, block ``i`` from rank
    ``i``): the blocks concatenated along ``concat``, ``split`` moved back; contiguous. ``shape``:
    the operand's local shape."""
    rest = [d for i, d in enumerate(shape) if i != split]
    at = concat + 1 if concat < split else concat  # NOTE: where concat sits once split leads
    blocks = g.call_function(aten.view.default, (arrived, [n, shape[split] // n, *rest]))
    beside = g.call_function(aten.movedim.int, (blocks, 0, at))
    merged = [*[shape[split] // n], *rest]
    merged[at] *= n
    whole = g.call_function(aten.reshape.default, (beside, merged))
    return contiguous(g, g.call_function(aten.movedim.int, (whole, 0, split))) if split else whole


def _permute(
    g: fx.Graph, x: fx.Node, dim: int, order: tuple[int, ...], n: int, coord: int, group: str, shape: list[int]
) -> Issued:
    """``comm.ppermute`` as one all-to-all with uneven splits: this rank's ``k`` pieces of ``dim``
    (``k = len(order) / n``) each sent to the rank whose slot ``j`` takes it (``order[j]``), in the
    order of those slots, and the pieces its own slots take received from their holders, put in
    slot order after. One piece per rank (a ring's pass) moves whole, as it lies: no copy."""
    k = len(order) // n
    mine = range(coord * k, coord * k + k)
    # NOTE: sent in order of the slot that takes each piece (slots of lower ranks first)
    sent = sorted((j, order[j] - coord * k) for j in range(len(order)) if order[j] in mine)
    # NOTE: what arrives is by sending rank, each rank's pieces in slot order: the same sort
    arrived = sorted(mine, key=lambda j: (order[j] // k, j))
    if k == 1:
        size = math.prod(shape)
        flat = g.call_function(aten.reshape.default, (x, [-1]))
        out = [size if order[coord] == r else 0 for r in range(n)]
        into = [size if sent[0][0] == r else 0 for r in range(n)]
        call = g.call_function(c10d.all_to_all_single.default, (flat, out, into, group))
        return Issued(call, lambda g, got: [g.call_function(aten.view.default, (got, shape))])
    rows = shape[dim] // k
    front = to_front(g, x, dim)
    pieces = g.call_function(aten.chunk.default, (front, k, 0))
    in_order = [i for _, i in sent] == list(range(k))
    send = front if in_order else g.call_function(aten.cat.default, ([_at(g, pieces, i) for _, i in sent],))
    out_rows = [rows * sum(1 for j in mine if order[j] // k == r) for r in range(n)]
    in_rows = [rows * sum(1 for j, _ in sent if j // k == r) for r in range(n)]
    call = g.call_function(c10d.all_to_all_single.default, (send, out_rows, in_rows, group))

    def placed(g: fx.Graph, got: fx.Node) -> list[fx.Node]:
        if arrived == list(mine):
            return [from_front(g, got, dim)]
        parts = g.call_function(aten.chunk.default, (got, k, 0))
        at = {j: i for i, j in enumerate(arrived)}
        return [from_front(g, g.call_function(aten.cat.default, ([_at(g, parts, at[j]) for j in mine],)), dim)]

    return Issued(call, placed)


def _at(g: fx.Graph, parts: fx.Node, i: int) -> fx.Node:
    return g.call_function(operator.getitem, (parts, i))


def _averaged(g: fx.Graph, x: fx.Node, n: int, reduce: str) -> fx.Node:
    return g.call_function(aten.div.Tensor, (x, n)) if reduce == "avg" else x


def _bucket(g: fx.Graph, op: Op, xs: list[fx.Node], n: int, group: str, local: list[list[int]], gloo: bool) -> Issued:
    """A bucketed all-gather or reduce-scatter: every operand, moved so its dim leads, is flattened
    into one buffer (reduce-scatter: as ``[n, chunk]`` rows, so rank r's rows land on rank r), one
    collective runs on it (on gloo, as ``issue`` sends it), and each result is cut back out and
    reshaped."""
    dims = [int(d) for d in op.kwarg("dims")]
    fronts = [to_front(g, x, d) for x, d in zip(xs, dims, strict=True)]
    shapes = [[s[d], *s[:d], *s[d + 1 :]] for s, d in zip(local, dims, strict=True)]  # dim d in front
    total = sum(math.prod(s) for s in shapes)  # NOTE: elements of this rank's operands
    if op.target == ALL_GATHER_BUCKET:
        flat = g.call_function(aten.cat.default, ([g.call_function(aten.reshape.default, (f, [-1])) for f in fronts],))

        def gathered(g: fx.Graph, full: fx.Node) -> list[fx.Node]:
            rows = g.call_function(aten.reshape.default, (full, [n, -1]))
            outs, off = [], 0
            for shape, d in zip(shapes, dims, strict=True):
                size = math.prod(shape)
                piece = g.call_function(aten.slice.Tensor, (rows, 1, off, off + size))
                whole = g.call_function(aten.reshape.default, (piece, [n * shape[0], *shape[1:]]))
                outs.append(from_front(g, whole, d) if d else contiguous(g, whole))
                off += size
            return outs

        if gloo:
            return _gather_by_all_to_all(g, flat, 1, total, n, group, gathered)
        return Issued(g.call_function(c10d.all_gather_into_tensor.default, (flat, n, group)), gathered)
    reduce = str(op.kwarg("reduce"))
    rows_in = [g.call_function(aten.reshape.default, (f, [n, -1])) for f in fronts]
    flat = g.call_function(aten.reshape.default, (g.call_function(aten.cat.default, (rows_in, 1)), [-1]))

    def scattered(g: fx.Graph, mine: fx.Node) -> list[fx.Node]:
        mine = _averaged(g, mine, n, reduce)
        outs, off = [], 0
        for shape, d in zip(shapes, dims, strict=True):
            size = math.prod(shape) // n
            piece = g.call_function(aten.slice.Tensor, (mine, 0, off, off + size))
            part = g.call_function(aten.reshape.default, (piece, [shape[0] // n, *shape[1:]]))
            outs.append(from_front(g, part, d) if d else contiguous(g, part))
            off += size
        return outs

    if gloo:
        return _scatter_by_all_to_all(g, flat, [n, total // n], group, scattered)
    return Issued(g.call_function(c10d.reduce_scatter_tensor.default, (flat, "sum", n, group)), scattered)


def _reduce_bucket(g: fx.Graph, op: Op, xs: list[fx.Node], n: int, group: str, local: list[list[int]]) -> Issued:
    """A bucketed all-reduce: every operand flattened into one buffer, one all-reduce on it (gloo's
    own: it costs less than an all-to-all of the blocks and another of the sums), and each result a
    view of its piece of what arrives (no copy: the results live as long as each other, gradients)."""
    reduce = str(op.kwarg("reduce"))
    flat = g.call_function(aten.cat.default, ([g.call_function(aten.reshape.default, (x, [-1])) for x in xs],))
    call = g.call_function(c10d.all_reduce.default, (flat, "sum" if reduce == "avg" else reduce, group))

    def reduced(g: fx.Graph, out: fx.Node) -> list[fx.Node]:
        whole = _averaged(g, out, n, reduce)
        outs, off = [], 0
        for shape in local:
            size = math.prod(shape)
            piece = g.call_function(aten.slice.Tensor, (whole, 0, off, off + size))
            outs.append(g.call_function(aten.view.default, (piece, shape)))
            off += size
        return outs

    return Issued(call, reduced)


def local_shapes(op: Op, mesh: Mesh) -> list[list[int]]:
    """Each operand's local shape (``Layout.local_shape``)."""
    out = []
    for v in op.operands:
        assert isinstance(v.type, TensorType)
        out.append(list(v.layout.local_shape(v.type.shape, mesh)))
    return out


def contiguous(g: fx.Graph, x: fx.Node) -> fx.Node:
    return g.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})


def to_front(g: fx.Graph, x: fx.Node, dim: int) -> fx.Node:
    """``x`` with ``dim`` moved to the front, contiguous (collectives work on dim 0)."""
    return contiguous(g, g.call_function(aten.movedim.int, (x, dim, 0)) if dim else x)


def from_front(g: fx.Graph, x: fx.Node, dim: int) -> fx.Node:
    return contiguous(g, g.call_function(aten.movedim.int, (x, 0, dim))) if dim else x


def chunk(g: fx.Graph, x: fx.Node, dim: int, n: int, coord: int) -> fx.Node:
    """This rank's contiguous chunk of ``x`` along ``dim`` (a local slice, no communication)."""
    parts = g.call_function(aten.chunk.default, (x, n, dim))
    piece = g.call_function(operator.getitem, (parts, coord))
    return g.call_function(aten.clone.default, (piece,), {"memory_format": torch.contiguous_format})
