"""Context parallelism: how attention reads a sequence split over a ``cp`` mesh axis.

``parallelize(..., plan="cp", cp={"method": ...})`` splits each input's sequence over the ``cp`` axes
(``plans.sequence_axes``). Every op but attention follows by sharding propagation; attention has
two ways to stay split, and ``CpSpec.method`` says which the sharding solve may choose:

* ``"ulysses"``: an all-to-all turns the sequence split into a split by heads (or by batch, where
  the batch divides) and back after the kernel: each rank attends whole sequences of some heads.
* ``"ring"``: the attention stays split by sequence and runs as ring attention
  (``rules.attention.ring_strategy``, lowered by ``backends/context_parallel/ring_lowering.py``): keys and values are
  passed round the axis's ranks while each block computes.
* ``"tokenring"``: split by sequence too, run as TokenRing (``backends/context_parallel/tokenring.py``): the queries
  travel one way and the block results the other, the keys and values stay.
* ``"auto"`` (the default): whichever the solve prices cheaper for each attention (ring attention's
  traffic, where it exceeds the blocks it overlaps, or Ulysses' all-to-alls).

``allows`` is the filter the solve and the greedy choice apply on each axis, ``priced`` what a
sequence split sends under the method; ``check`` refuses a
``"ring"`` or ``"tokenring"`` request an attention op of the graph cannot meet, naming it, before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from meshfold.ir import Graph, Op, TensorType
from meshfold.ir.dialects.conv import CONV
from meshfold.ir.dialects.scan import SCAN
from meshfold.passes.base import PassError
from meshfold.passes.sharding.cost import nbytes
from meshfold.passes.sharding.plans import AUTO
from meshfold.passes.sharding.rules.attention import RESULT_ROLES, RING_KERNELS, ring_blocker
from meshfold.passes.sharding.rules.operands import operand_names, tensor_type_of
from meshfold.passes.sharding.strategy import Strategy

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

METHODS = ("auto", "ring", "tokenring", "ulysses")
SEQUENCE = ("ring", "tokenring")
"""The methods that keep attention split by sequence (its ring strategy), and nothing else."""


@dataclass(frozen=True)
class CpSpec:
    """What ``parallelize(cp=...)`` asks of the ``cp`` axes: the attention ``method``."""

    method: str = "auto"

    @staticmethod
    def of(spec: CpSpec | Mapping[str, Any] | str | None) -> CpSpec:
        """``{"method": "ring"}``, ``"ring"``, a ``CpSpec`` or None (the default); raises ``PassError``
        naming an unknown key or method."""
        if spec is None:
            return CpSpec()
        if isinstance(spec, CpSpec):
            out = spec
        elif isinstance(spec, str):
            out = CpSpec(spec)
        else:
            unknown = sorted(set(spec) - {"method"})
            if unknown:
                raise PassError(f"cp= takes the key 'method'; unknown: {', '.join(unknown)}")
            out = CpSpec(str(spec.get("method", "auto")))
        if out.method not in METHODS:
            raise PassError(f"cp method {out.method!r} is unknown; use one of {', '.join(METHODS)}")
        return out


def method_of(ctx: PassContext) -> str:
    """The method a compilation's context asks for (``CpSpec()``'s when it says none)."""
    return (ctx.options.cp or CpSpec()).method


def allows(op: Op, s: Strategy, role: str, method: str, earlier: Sequence[Strategy]) -> bool:
    """Whether strategy ``s`` of ``op`` may be chosen on a mesh axis with ``role`` in the plan (a
    preset's, or ``auto``) after the ``earlier`` axes' strategies: a ring strategy on a ``cp`` axis
    whose method is not ``"ulysses"``, or on any axis under ``plan="auto"`` (which chooses where the
    sequence splits itself), and on one axis only; with ``"ring"`` or ``"tokenring"``, an attention
    on a ``cp`` axis nothing else. A running sum along a split dim (``Strategy.state``) on one axis,
    whatever the method."""
    if s.state > 0:  # NOTE: a running sum along a split dim (LASP-2's memory states): any method, one axis
        return not any(e.state > 0 for e in earlier)
    if s.passed > 0:
        return (role == AUTO or (role == "cp" and method != "ulysses")) and not any(e.passed > 0 for e in earlier)
    return not (role == "cp" and method in SEQUENCE and op.target in RESULT_ROLES and ring_blocker(op) is None)


_TRAVEL = {
    RING_KERNELS[0]: ("query", "attn_mask"),
    RING_KERNELS[1]: ("grad_out", "query", "out", "logsumexp", "attn_mask"),
}
"""What travels from each rank under TokenRing, per kernel: the queries (with their mask rows), and
backward the output, its gradient and log-sum-exp with them; the results (forward: output and
log-sum-exp; backward: the query gradients) come back."""


def priced(op: Op, s: Strategy, method: str) -> Strategy:
    """``s`` with what it sends under ``method``: the rule prices ring attention (the keys and values
    round the ring); TokenRing sends the queries (and what travels with them) and gets the results
    back instead."""
    if method != "tokenring" or s.passed <= 0 or op.target not in _TRAVEL:
        return s
    names = operand_names(op)
    out = [tensor_type_of(v) for n, v in zip(names, op.operands, strict=True) if n in _TRAVEL[op.target]]
    back = op.results[:2] if op.target == RING_KERNELS[0] else op.results[:1]
    sent = sum(nbytes(t) for t in [*out, *(tensor_type_of(r) for r in back)] if t is not None)
    return replace(s, passed=sent)


def check(graph: Graph, axes: Sequence[str], method: str, sizes: Mapping[str, int] | None = None) -> None:
    """Raise, naming the first attention that cannot be split by sequence and why, when ``method``
    is ``"ring"`` or ``"tokenring"`` on the ``cp`` ``axes``; with ``"ulysses"``, the first whose
    heads and batch both do not divide over an axis's ranks (``sizes``)."""
    if not axes:
        return
    for op in graph.ops:
        if op.target not in RESULT_ROLES:
            continue
        why = ring_blocker(op) if method in SEQUENCE else None
        if why is not None:
            raise PassError(
                f"{op.describe()}: cp={{'method': {method!r}}} splits every attention by sequence, but {why}; "
                "use cp={'method': 'ulysses'} (split by heads) for this model"
            )
        q = op.operands[0].type
        if method != "ulysses" or sizes is None or not isinstance(q, TensorType) or op.prov.phase != "fwd":
            continue
        batch, heads = q.shape[0], q.shape[1]
        for axis in axes:
            n = sizes[axis]
            if all(isinstance(d, int) and d % n for d in (batch, heads)):
                raise PassError(
                    f"{op.describe()}: cp={{'method': 'ulysses'}} splits attention by heads (or batch), but its "
                    f"{heads} heads and batch of {batch} do not divide over the {n} ranks of {axis!r}; use a cp "
                    "size that divides one of them, or cp={'method': 'ring'} (split by sequence)"
                )


_HOW = {"ring": "ring attention", "tokenring": "TokenRing", "auto": "ring attention"}


def describe(graph: Graph, axes: Sequence[str], method: str) -> tuple[str, ...]:
    """One line per ``cp`` axis of the laid-out ``graph``: how its forward attentions read the split
    sequence (by sequence, as ring attention or TokenRing; by heads or batch, through Ulysses'
    all-to-alls)."""
    lines = []
    for axis in axes:
        ways: dict[str, int] = {}
        for op in graph.ops:
            if op.target in RESULT_ROLES and op.prov.phase == "fwd":
                q = op.operands[0]
                rank = q.type.rank if isinstance(q.type, TensorType) else 0
                dim = getattr(q.layout.placement(axis), "dim", None)
                way = {rank - 2: f"by sequence ({_HOW.get(method, method)})", 1: "by heads (Ulysses)", 0: "by batch"}
                key = way.get(dim, "whole") if dim is not None else "whole"
                ways[key] = ways.get(key, 0) + 1
        if ways:
            split = ", ".join(f"{n} {how}" for how, n in ways.items())
            lines.append(f"context parallel on {axis!r}: attention split {split}")
        lines.extend(_sequence_ops(graph, axis))
    return tuple(lines)


def _sequence_ops(graph: Graph, axis: str) -> list[str]:
    """How the forward linear recurrences and causal convolutions of ``graph`` are laid out on
    ``axis``: by steps (each rank its part of the sequence), by other dims, or whole."""
    counts: dict[tuple[str, str], int] = {}
    for op in graph.ops:
        if op.prov.phase != "fwd" or op.target not in (SCAN, CONV):
            continue
        x = op.operands[0]
        rank = x.type.rank if isinstance(x.type, TensorType) else 0
        along = rank - 3 if op.target == SCAN else 2
        dim = getattr(x.layout.placement(axis), "dim", None)
        how = "whole" if dim is None else "by sequence" if dim == along else "by other dims"
        kind = "recurrences" if op.target == SCAN else "causal convolutions"
        counts[kind, how] = counts.get((kind, how), 0) + 1
    return [f"context parallel on {axis!r}: {kind} {n} {how}" for (kind, how), n in counts.items()]
