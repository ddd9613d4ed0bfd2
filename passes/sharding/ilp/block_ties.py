"""Which ops and free inputs of the sharding solve share columns: those of repeated blocks."""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.ir import Value
from meshfold.passes.blocks import mirrored_inputs, mirrors
from meshfold.passes.sharding.ilp.problem import Problem


@dataclass(frozen=True)
class Ties:
    """Which ops and free inputs mirror an earlier block's (see ``passes.blocks``): they share the
    program's columns (``Problem.share_blocks``)."""

    ops: dict[int, int]
    inputs: dict[Value, Value]

    @staticmethod
    def of(problem: Problem) -> Ties:
        if not problem.share_blocks:
            return Ties({}, {})
        graph = problem.graph
        blocks, mirrored = problem.mirrored if problem.mirrored is not None else mirrors(graph)
        ops = {i: r for i, r in mirrored.items() if problem.candidates[i] == problem.candidates[r]}
        by_name = {i.name: i.value for i in graph.inputs}
        inputs = {
            by_name[n]: by_name[t]
            for n, t in mirrored_inputs(graph, blocks).items()
            if by_name[n] in problem.free and by_name[t] in problem.free and by_name[n].type == by_name[t].type
        }
        return Ties(ops, inputs)
