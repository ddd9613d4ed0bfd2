"""Layout consistency: on every mesh axis, each op's operand and result placements must be one of
the strategies its rule allows. Together with SSA this means every consumer reads its operand in
exactly the layout the producer wrote (collectives are explicit ops)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from operator import attrgetter

from meshfold.ir import Graph, Op, OpDef, VerifyError
from meshfold.ir.ops import REDISTRIBUTE
from meshfold.ir.verifier import key_classes
from meshfold.passes.sharding.rules import rule_table, strategies_for
from meshfold.passes.sharding.strategy import Strategy

_LAYOUT = attrgetter("layout")


def check_layouts(graph: Graph, *, allow_redistribute: bool = True, classes: Sequence[int] | None = None) -> None:
    """Raise ``VerifyError`` naming the op, its module path and source, and the layouts involved.
    ``classes``: ``key_classes(graph.ops)``, where the caller has it."""
    if graph.mesh is None:
        return
    table = rule_table()
    if classes is None:
        classes = key_classes(graph.ops)
    # NOTE: a rule reads the op's types and arguments only, so ops of one ``Op.key`` (one number of
    # ``key_classes``: the same op in every layer of a stack) share their strategies, and with the
    # same layouts their verdict; a collective's verdict reads its target, attributes and layouts
    # alone. Verdicts are kept by the layouts' identities first (the graph holds the layouts, so no id
    # is reused while this runs): hashing a ``Layout`` is Python calls, and the ops of every layer
    # mostly share layout objects
    passed: set[Hashable] = set()
    passed_ids: set[Hashable] = set()
    known: dict[Hashable, list[Strategy]] = {}
    for op, number in zip(graph.ops, classes, strict=True):
        collective = isinstance(op.target, OpDef)
        if op.target == REDISTRIBUTE and not allow_redistribute:
            raise VerifyError(f"{op.describe()}: comm.redistribute left after boxing")
        what = (op.target, op.kwargs) if collective else number
        # NOTE: one flat tuple (the operand count splits it) is made faster than one per side
        by_ids = (what, len(op.operands), *[id(v.layout) for v in op.operands + op.results])
        if by_ids in passed_ids:
            continue
        ins, outs = tuple(map(_LAYOUT, op.operands)), tuple(map(_LAYOUT, op.results))
        if (what, ins, outs) not in passed:
            if collective:
                _check_collective(graph, op)
            else:
                if what not in known:
                    known[what] = strategies_for(op, table)[0]
                _check_rule(graph, op, known[what])
            passed.add((what, ins, outs))
        passed_ids.add(by_ids)


def _check_rule(graph: Graph, op: Op, strategies: list[Strategy]) -> None:
    """On every mesh axis, the op's placements are one of ``strategies`` (its rule's)."""
    assert graph.mesh is not None
    for i, axis in enumerate(graph.mesh.names):
        have = (
            tuple(v.layout.placements[i] for v in op.operands),
            tuple(r.layout.placements[i] for r in op.results),
        )
        if not any((s.inputs, s.outputs) == have for s in strategies):
            ins = ", ".join(f"%{v.name} {v.layout}" for v in op.operands)
            outs = ", ".join(f"%{r.name} {r.layout}" for r in op.results)
            raise VerifyError(
                f"{op.describe()}: on mesh axis {axis!r} the placements ({ins}) -> ({outs}) are not a "
                f"strategy of its sharding rule; a pass wrote inconsistent layouts (run boxing after sharding)"
            )


def _check_collective(graph: Graph, op: Op) -> None:
    """A collective changes its own axis's placement as its kind says and keeps every other axis."""
    assert graph.mesh is not None
    axis = op.kwarg("axis")
    assert isinstance(op.target, OpDef)
    if axis is None or op.target.move is None:
        return
    attrs = dict(op.kwargs)
    for k, (x, r) in enumerate(zip(op.operands, op.results, strict=True)):
        want = op.target.moves(attrs, k)
        for i, name in enumerate(graph.mesh.names):
            have = (x.layout.placements[i], r.layout.placements[i])
            expect = want if name == axis else (have[0], have[0])
            if have != expect:
                raise VerifyError(
                    f"{op.describe()}: on mesh axis {name!r} it takes %{x.name} {x.layout} to %{r.name} "
                    f"{r.layout}, but a {op.name} over {axis!r} goes {expect[0]} -> {expect[1]} there; "
                    "a pass wrote inconsistent layouts"
                )
