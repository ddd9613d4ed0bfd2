"""``sharding{mode=solve}``: choose every op's strategy by an integer program over the whole graph.

One mesh axis at a time (in mesh order, so an axis's choices see the shards the earlier axes put
on the same dims), a mixed-integer program picks one single-axis strategy per op:

* a binary ``x[o, s]`` per op ``o`` and valid strategy ``s`` with ``sum_s x[o, s] = 1``;
* a value's placement ``Y[u, p]`` is a sum of its producer's ``x`` (fixed for graph inputs, at the
  plan's compute placement);
* ``N[u, q, phase] >= sum of x[o, s]`` over consumers ``o`` in that phase whose strategy ``s`` needs
  ``u`` in ``q``: a value moved to a placement once per phase is shared by all its consumers
  there, as propagation shares the ``comm.redistribute``;
* ``W[u, p, q, phase] >= Y[u, p] + N[u, q, phase] - 1`` prices the move ``p -> q``.

The objective is time, priced by the one time model (``passes.cost.axis``: the hardware catalog's
roofline and the collective model the cluster simulator uses): per-op compute (the roofline of
the op's FLOPs and bytes on one device, divided over the axis when the strategy shards anything)
plus per-move collective time. The graph outputs are consumers too: the loss wants Replicate,
each gradient its parameter's storage layout. On a preset's data-parallel axes
(``Problem.batch_axes``) values computed from the inputs never leave their shard for an op.
HiGHS (``scipy.optimize.milp``) solves it exactly (``program.AxisProgram`` builds and runs it).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import replace
from typing import TYPE_CHECKING

from meshfold.ir import Graph, Layout, Mesh, Placement, Value
from meshfold.passes import cp
from meshfold.passes.base import PassError
from meshfold.passes.sharding.ilp.block_ties import Ties
from meshfold.passes.sharding.ilp.problem import AxisStart, AxisStats, Problem, Solution
from meshfold.passes.sharding.ilp.program import AxisProgram
from meshfold.passes.sharding.plans import AUTO, Plan, resolve, sequence_axes
from meshfold.passes.sharding.strategy import Strategy

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

__all__ = ["AxisStats", "Problem", "Solution", "preset_plan", "report", "seeded", "solve"]


def solve(problem: Problem, start: Solution | None = None) -> Solution:
    """Solve ``problem`` one mesh axis at a time (in mesh order). ``start``: a known plan (a
    preset's) each axis's search begins from, so what it returns on reaching its node limit is
    never worse on that axis."""
    graph, mesh = problem.graph, problem.mesh
    chosen: list[list[Strategy]] = [[] for _ in graph.ops]
    placed: dict[Value, list[Placement]] = {v: [] for v in problem.free}
    ties = Ties.of(problem)
    stats: list[AxisStats] = []
    work: dict[Hashable, tuple[float, float]] = {}
    for k, axis in enumerate(mesh.names):
        # NOTE: free inputs: ``plan="auto"``, where any axis may split the sequence
        role = "cp" if axis in problem.sequence_axes else AUTO if problem.free else ""
        per_op = []
        fits: dict[Hashable, list[Strategy]] = {}
        for i, op in enumerate(graph.ops):
            # NOTE: the earlier axes' strategies by identity: ops of one kind picked theirs from one list
            kind = (problem.keys[i], *map(id, chosen[i])) if problem.keys else i
            ok = fits.get(kind)
            if ok is None:  # NOTE: ops of one kind share the list (``AxisProgram`` prices it once)
                ok = fits[kind] = [
                    s
                    for s in problem.candidates[i]
                    if problem.valid(op, s, chosen[i]) and cp.allows(op, s, role, problem.cp_method, chosen[i])
                ]
            if not ok:
                raise PassError(f"{op.describe()}: no valid sharding strategy on mesh axis {axis!r}")
            per_op.append(ok)
        later = math.prod(mesh.sizes[k + 1 :])
        budget = None if problem.memory is None else problem.memory * later
        program = AxisProgram(problem, axis, per_op, chosen, placed, budget, ties, work)
        with problem.status(f"sharding solve: mesh axis {axis!r}, {len(graph.ops)} ops"):
            hint = None
            if start is not None:
                hint = AxisStart(
                    [ss[k] for ss in start.strategies], {v: lay.placement(axis) for v, lay in start.inputs.items()}
                )
            picks, inputs = program.solve(hint)
        stats.append(program.stats)
        for i, s in enumerate(picks):
            chosen[i].append(s)
        for v, p in inputs.items():
            placed[v].append(p)
    layouts = {v: Layout(mesh.names, tuple(ps)) for v, ps in placed.items()}
    return Solution(chosen, layouts, tuple(stats))


def report(ctx: PassContext, solution: Solution) -> None:
    """The solve's figures into ``ctx.stats``, and a warning for each axis a node limit stopped."""
    ctx.stats["sharding.solve"] = solution.stats
    ctx.stats["sharding.step_time"] = solution.step_time
    for s in solution.stats:
        if not s.optimal:
            ctx.warn(
                f"sharding solve on mesh axis {s.axis!r} stopped at its node limit ({s.nodes} nodes) with the "
                f"plan within {100 * s.gap:.1f}% of optimal; raise sharding{{node-limit=...}} to search further"
            )


def seeded(problem: Problem, preset: tuple[str, Solution] | None) -> Solution:
    """Solve ``problem``; if a node limit stops it, again from the preset's plan (so each axis's search
    is never worse than the preset on that axis). A first search without the start: HiGHS completing
    the preset's binaries into a first point cost more than the search (70B dims, dp axis: 1.03 s
    against 0.29 s)."""
    solution = solve(problem)
    if solution.optimal or preset is None:
        return solution
    return min(solution, solve(problem, start=preset[1]), key=lambda s: s.step_time)


def preset_plan(graph: Graph, mesh: Mesh, auto: Problem, name: str) -> tuple[str, Solution] | None:
    """Preset ``name`` (one of ``mesh_presets``) as a plan of the ``auto`` program: every free input
    fixed where the preset stores it (so a parameter the preset gathers for compute pays for the
    gather, as it would under ``auto``), each op's strategy solved. None when the plan pins expert
    weights (which presets do not lay out) or the preset has no plan (sizes it cannot split, a
    memory bound it cannot meet)."""
    try:
        seeds = resolve(Plan.of(name), graph, mesh)
    except PassError:
        return None
    stored = {i.value: seeds.storage.get(i.name, Layout.replicated(mesh)) for i in graph.inputs}
    wants: dict[int, Layout | Value] = {k: stored[w] if isinstance(w, Value) else w for k, w in auto.wants.items()}
    problem = replace(
        auto,
        start=dict(auto.start) | {v: stored[v] for v in auto.free},
        free=frozenset(),
        wants=wants,
        batch_axes=seeds.batch_axes(),
        sequence_axes=frozenset(sequence_axes(seeds.roles)),
    )
    try:
        plan = solve(problem)
    except PassError:
        return None
    return name, replace(plan, inputs={v: stored[v] for v in auto.free})
