"""Single-mesh-axis sharding strategies and the einsum-like notation that generates them.

A rule answers, for one op and ONE mesh axis, which combinations of operand placements it accepts
and what placements its results then have. Rules never see the mesh: propagation expands them to
N-D meshes by choosing one strategy per axis, and filters out shardings of dims a mesh axis does
not divide.

Notation: one group of dim letters per tensor operand, ``->``, one group per result.
``"m k, k n -> m n"`` is matmul: sharding a letter shards that dim wherever it appears; a letter
absent from a result makes that result ``Partial(reduce)``; ``_`` marks a dim that must stay whole
(a broadcast dim of size 1, a softmax dim). Operands listed in ``linear`` may carry a Partial
through the op when every other operand is Replicate (``mul``, ``mm``); ``additive`` ops accept all
operands Partial (``add``, ``cat``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshfold.ir import Layout, Mesh, Partial, Placement, R, Shard, TensorType, Value
from meshfold.ir.placement import ReduceOp
from meshfold.ir.symbolic import divides


@dataclass(frozen=True, slots=True)
class Strategy:
    """Placements on one mesh axis: one per tensor operand (``op.operands`` order), one per result."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    exchange: float = 0.0
    """Bytes the op itself moves among the axis's ranks under this strategy, as if the axis were
    infinitely large (each rank sends its ``1/n`` share, ``(n-1)/n`` of it to others); 0 for the
    ordinary op that communicates only through the collectives boxing inserts."""
    passed: float = 0.0
    """Bytes the op passes round a ring of the axis's ranks under this strategy (ring attention's keys
    and values), whole-tensor bytes: each rank sends its ``1/n`` share ``n - 1`` times, the volume
    of an all-gather, while it computes; 0 for every other op."""
    state: float = 0.0
    """Bytes of the state each rank contributes to an all-gather the op makes itself under this
    strategy (a running sum along a split dim: each rank's total, the memory state of linear
    attention, whose size does not depend on the sequence); 0 for every other op."""

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        outs = ", ".join(map(str, self.outputs))
        return f"({ins}) -> ({outs})"


@dataclass(frozen=True, slots=True)
class Einsum:
    """A parsed notation: dim letters per operand and per result."""

    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]

    @staticmethod
    def parse(text: str) -> Einsum:
        """``"m k, k n -> m n"``; each dim is one token (letters, digits, ``_``), groups split by commas."""
        lhs, arrow, rhs = text.partition("->")
        if not arrow:
            raise ValueError(f"sharding notation {text!r} needs '->'")

        def groups(side: str) -> tuple[tuple[str, ...], ...]:
            if not side.strip():
                return ()
            return tuple(tuple(g.split()) for g in side.split(","))

        # NOTE: an empty left side is an op without tensor operands (a factory); an empty right side
        # is one 0-d result (``"k, k -> "`` is a dot product), since every op has a result.
        return Einsum(groups(lhs), groups(rhs) or ((),))


def einsum_strategies(
    spec: str | Einsum,
    *,
    linear: Sequence[int] = (),
    additive: bool = False,
    reduce: ReduceOp = "sum",
    extra_outputs: int = 0,
) -> list[Strategy]:
    """Every single-axis strategy the notation allows.

    ``reduce`` is the Partial kind of results that lose a sharded letter (``sum`` for contractions,
    ``avg`` for means, ``max`` for amax). ``extra_outputs`` appends that many Replicate results
    (for ops with non-tensor or bookkeeping results the notation does not describe).
    """
    e = Einsum.parse(spec) if isinstance(spec, str) else spec
    n_in, n_out = len(e.operands), len(e.results)
    rr = tuple(R for _ in range(extra_outputs))
    out: list[Strategy] = [Strategy(tuple(R for _ in range(n_in)), tuple(R for _ in range(n_out)) + rr)]
    letters: list[str] = []
    for group in (*e.operands, *e.results):
        for d in group:
            if d != "_" and not d.isdigit() and d not in letters:
                letters.append(d)
    for letter in letters:
        ins = tuple(Shard(g.index(letter)) if letter in g else R for g in e.operands)
        if not any(isinstance(p, Shard) for p in ins):
            continue  # a letter only results have (e.g. a broadcast dim created by the op)
        outs = tuple(Shard(g.index(letter)) if letter in g else Partial(reduce) for g in e.results)
        out.append(Strategy(ins, outs + rr))
    kinds: tuple[ReduceOp, ...] = ("sum", "avg")
    for i in linear:
        for kind in kinds:
            ins_p: tuple[Placement, ...] = tuple(Partial(kind) if j == i else R for j in range(n_in))
            out.append(Strategy(ins_p, tuple(Partial(kind) for _ in range(n_out)) + rr))
    if additive and n_in > 1:
        for kind in kinds:
            out.append(
                Strategy(tuple(Partial(kind) for _ in range(n_in)), tuple(Partial(kind) for _ in range(n_out)) + rr)
            )
    return _dedupe(out)


def replicate_only(n_in: int, n_out: int) -> list[Strategy]:
    """The one strategy every op supports: everything Replicate."""
    return [Strategy(tuple(R for _ in range(n_in)), tuple(R for _ in range(n_out)))]


def _dedupe(strategies: list[Strategy]) -> list[Strategy]:
    return list(dict.fromkeys(strategies))


def fits_axis(
    s: Strategy, operands: list[Value], results: tuple[Value, ...], mesh: Mesh, earlier: list[Strategy]
) -> bool:
    """Every Shard divides its dim (with the axes chosen before this one that shard the same dim),
    non-tensors stay Replicate, and Partial appears only on floating-point tensors."""
    n = mesh.sizes[len(earlier)]
    pairs = [*zip(operands, s.inputs, strict=True), *zip(results, s.outputs, strict=True)]
    for pos, (v, p) in enumerate(pairs):
        t = v.type
        if not isinstance(t, TensorType):
            if not _is_replicate(p):
                return False
            continue
        if isinstance(p, Shard):
            ways = n
            for a, e in enumerate(earlier):
                q = (e.inputs + e.outputs)[pos]
                if isinstance(q, Shard) and q.dim == p.dim:
                    ways *= mesh.sizes[a]
            size = t.shape[p.dim] if p.dim < t.rank else None
            if size is None or not divides(size, ways):
                return False
        if isinstance(p, Partial) and not t.dtype.is_floating_point:
            return False
    return True


def keeps_pinned(
    s: Strategy, operands: Sequence[Value], pinned: Mapping[Value, Layout], earlier: list[Strategy]
) -> bool:
    """Whether ``s`` reads every pinned operand in its pinned placement on this axis."""
    axis = len(earlier)
    return all(v not in pinned or p == pinned[v].placements[axis] for v, p in zip(operands, s.inputs, strict=False))


def _is_replicate(p: Placement) -> bool:
    return not isinstance(p, (Shard, Partial))
