"""Layout consistency: on every mesh axis, each op's operand and result placements must be one of
the strategies its rule allows. Together with SSA this means every consumer reads its operand in
exactly the layout the producer wrote (collectives are explicit ops)."""

from __future__ import annotations

from ir import Graph, OpDef, VerifyError
from ir.ops import REDISTRIBUTE
from passes.sharding.rules import rule_table, strategies_for


def check_layouts(graph: Graph, *, allow_redistribute: bool = True) -> None:
    """Raise ``VerifyError`` naming the op, its module path and source, and the layouts involved."""
    if graph.mesh is None:
        return
    table = rule_table()
    for op in graph.ops:
        if isinstance(op.target, OpDef):
            if op.target == REDISTRIBUTE and not allow_redistribute:
                raise VerifyError(f"{op.describe()}: comm.redistribute left after boxing")
            continue
        strategies, _ = strategies_for(op, table)
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
