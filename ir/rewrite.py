"""One rewrite driver for local rewrites, with pattern tables keyed by op target.

A pattern sees an op whose operands are already rewritten and returns either ``None`` (no change)
or the values that replace the op's results (existing values, or new ones it emitted through the
``Rewriter``). It reads nothing but its op and the producers of that op's operands
(``Rewriter.producer``): a later sweep asks it again only about ops where one of those changed. The
driver sweeps the graph in order until nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshfold.ir.graph import Arg, Graph, GraphBuilder, Op, Provenance, Value, remap_op
from meshfold.ir.memo import Kept, by_identity
from meshfold.ir.ops import Target

Pattern = Callable[["Rewriter", Op], Sequence[Value] | None]


@dataclass
class PatternTable:
    """Patterns registered by decorator, per target (``None`` = applies to every op)."""

    name: str
    patterns: dict[Target | None, list[Pattern]] = field(default_factory=dict)
    _asked: Kept[Target, list[Pattern]] = field(default_factory=dict, repr=False, compare=False)
    """``for_target``'s answers (a sweep asks for every op), emptied when a pattern registers."""

    def register(self, *targets: Target | None) -> Callable[[Pattern], Pattern]:
        """``@table.register(aten.view.default, aten.reshape.default)`` adds a pattern."""

        def deco(fn: Pattern) -> Pattern:
            for t in targets or (None,):
                self.patterns.setdefault(t, []).append(fn)
            self._asked.clear()
            return fn

        return deco

    def for_target(self, target: Target) -> list[Pattern]:
        return by_identity(self._asked, target, self._for)

    def _for(self, target: Target) -> list[Pattern]:
        return self.patterns.get(target, []) + self.patterns.get(None, [])


class Rewriter:
    """What a pattern may use: look up producers in the graph being built, and emit new ops.

    ``source``: the graph being rewritten, whose ops the builder receives either through ``append``
    (new or changed ops) or directly, unchanged and in order (each then still defines its results)."""

    def __init__(self, builder: GraphBuilder, source: Graph | None = None) -> None:
        self.builder = builder
        self._defs: dict[Value, Op] = {}
        self._source = source
        self._before: dict[Value, Op] | None = None

    def append(self, op: Op) -> None:
        self.builder.append(op)
        for r in op.results:
            self._defs[r] = op

    def producer(self, value: Arg) -> Op | None:
        """The op defining ``value`` in the new graph (``None`` for graph inputs and literals)."""
        if not isinstance(value, Value):
            return None
        op = self._defs.get(value)
        if op is None and self._source is not None:
            # NOTE: made on the first question: a sweep that keeps most ops need not note each
            if self._before is None:
                self._before = self._source.producers()
            op = self._before.get(value)
        return op

    def emit(
        self, target: Target, args: Sequence[Arg], kwargs: Sequence[tuple[str, Arg]], like: Op
    ) -> tuple[Value, ...]:
        """Emit ``target`` with ``like``'s result names, types, layouts and provenance."""
        results = tuple(Value(r.name, r.type, r.layout) for r in like.results)
        self.append(Op(target, tuple(args), tuple(kwargs), results, like.prov))
        return results

    def emit_op(
        self,
        target: Target,
        args: Sequence[Arg],
        results: Sequence[Value],
        prov: Provenance,
        kwargs: Sequence[tuple[str, Arg]] = (),
    ) -> None:
        self.append(Op(target, tuple(args), tuple(kwargs), tuple(results), prov))


def apply_patterns(graph: Graph, table: PatternTable, max_sweeps: int = 8, settled: set[Op] | None = None) -> Graph:
    """Rewrite ``graph`` with ``table`` until a sweep changes nothing (or ``max_sweeps``); where no
    pattern fires, the graph returned (a plain ``Graph``, as always) has ``graph``'s very ``ops``.

    ``settled`` (kept up to date here) is for a caller that rewrites the graphs of one pass with
    ``table`` again after changing them otherwise (without ever bringing back an op it dropped): the
    ops no pattern rewrote, as they were checked. A sweep asks the patterns again only about ops not
    in it and ops reading a value whose producer changed since, on the contract that a pattern reads
    only its op and the producers of its operands (``Rewriter.producer``).
    """
    known: set[Op] = set() if settled is None else settled
    out = graph
    for _ in range(max_sweeps):
        out, changed = _sweep(out, table, known)
        if not changed:
            break
    if out is graph:
        return Graph(graph.name, graph.inputs, graph.ops, graph.outputs, graph.mesh, graph.stacks)
    return out


def _sweep(graph: Graph, table: PatternTable, settled: set[Op]) -> tuple[Graph, bool]:
    if settled.issuperset(graph.ops):
        return graph, False  # NOTE: every op was asked, against the producers it has: none would fire
    b = GraphBuilder.like(graph)
    rw = Rewriter(b, graph)
    vmap: dict[Value, Value] = {}
    fresh: set[Value] = set()
    """Values replaced in this sweep, or defined by an op the patterns saw for the first time (an op
    asked again because an operand is fresh, and kept as it was, leaves its results as they were)."""
    changed = False
    for op in graph.ops:
        # NOTE: a settled op whose operands still have the producers it was checked against would get
        # the same answers again; most ops of a later sweep are appended here unasked.
        known = op in settled
        if known and fresh.isdisjoint(op.operands):
            b.append(op)
            continue
        new_op = remap_op(op, vmap)
        replacement = _rewrite(rw, table, new_op)
        if replacement is None:
            if new_op is op:
                b.append(op)
            else:
                rw.append(new_op)
            if new_op is not op or not known:
                settled.add(new_op)
                fresh.update(new_op.results)
            continue
        changed = True
        if len(replacement) != len(op.results):
            raise ValueError(
                f"pattern in {table.name!r} replaced {len(op.results)} results of {op.describe()} "
                f"with {len(replacement)} values"
            )
        for old, new in zip(op.results, replacement, strict=True):
            vmap[old] = new
        fresh.update(op.results)
    if not changed:
        return graph, False
    for o in graph.outputs:
        b.add_output(o.kind, o.name, vmap.get(o.value, o.value))
    return b.build(), True


def _rewrite(rw: Rewriter, table: PatternTable, op: Op) -> Sequence[Value] | None:
    """The first pattern's replacement of ``op``'s results, or ``None`` where none fires."""
    for pattern in table.for_target(op.target):
        replacement = pattern(rw, op)
        if replacement is not None:
            return replacement
    return None
