"""One rewrite driver for local rewrites, with pattern tables keyed by op target.

A pattern sees an op whose operands are already rewritten and returns either ``None`` (no change)
or the values that replace the op's results (existing values, or new ones it emitted through the
``Rewriter``). The driver sweeps the graph in order until nothing changes.
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
    """What a pattern may use: look up producers in the graph being built, and emit new ops."""

    def __init__(self, builder: GraphBuilder) -> None:
        self.builder = builder
        self._defs: dict[Value, Op] = {}

    def append(self, op: Op) -> None:
        self.builder.append(op)
        for r in op.results:
            self._defs[r] = op

    def producer(self, value: Arg) -> Op | None:
        """The op defining ``value`` in the new graph (``None`` for graph inputs and literals)."""
        return self._defs.get(value) if isinstance(value, Value) else None

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


def apply_patterns(graph: Graph, table: PatternTable, max_sweeps: int = 8) -> Graph:
    """Rewrite ``graph`` with ``table`` until a sweep changes nothing (or ``max_sweeps``)."""
    for _ in range(max_sweeps):
        graph, changed = _sweep(graph, table)
        if not changed:
            break
    return graph


def _sweep(graph: Graph, table: PatternTable) -> tuple[Graph, bool]:
    b = GraphBuilder.like(graph)
    rw = Rewriter(b)
    vmap: dict[Value, Value] = {}
    changed = False
    for op in graph.ops:
        new_op = remap_op(op, vmap)
        replacement: Sequence[Value] | None = None
        for pattern in table.for_target(new_op.target):
            replacement = pattern(rw, new_op)
            if replacement is not None:
                break
        if replacement is None:
            rw.append(new_op)
            continue
        changed = True
        if len(replacement) != len(op.results):
            raise ValueError(
                f"pattern in {table.name!r} replaced {len(op.results)} results of {op.describe()} "
                f"with {len(replacement)} values"
            )
        for old, new in zip(op.results, replacement, strict=True):
            vmap[old] = new
    for o in graph.outputs:
        b.add_output(o.kind, o.name, vmap.get(o.value, o.value))
    return b.build(), changed
