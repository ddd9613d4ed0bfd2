"""The budget's integer program: at every point of the schedule where the predicted memory is over
the budget, the chosen ways to free memory must free the excess there.

A saved activation lives in the keep program from its forward op to the end of the backward (the
autograd context holds it). Recomputed or offloaded, it lives until its last forward reader, then
again from the way's first backward reader (a recomputed chain is made in one go, before the first
backward op that reads any of it; a reload, before the value's own first reader) to its last: it
is absent between and after. A recompute also makes the backward read what its ops read and the
forward did not save (a GEMM's output under a recomputed activation): those live from their last
forward reader until the recompute. So each way frees, at each point, the bytes of its values
absent there less the bytes it newly holds there; storage is counted once (a view's bytes are its
base's). A way may also shrink an op's own working set (the routed experts computed in smaller
pieces): that frees bytes only while the op runs. The points over budget are grouped by what every
way frees there (one row per group, at the group's largest excess), so the program has a row per
distinct stretch of the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
from scipy.sparse import csc_array

from meshfold.ir import Graph, Op, Value
from meshfold.ir.graph import local_nbytes
from meshfold.passes.cost.liveness import MemoryEstimate, alias_roots
from meshfold.passes.sharding.ilp.milp import solve_milp


class Way(Protocol):
    @property
    def values(self) -> frozenset[Value]:
        """The saved activations it frees."""

    @property
    def adds(self) -> frozenset[Value]:
        """The values it makes the backward read that the keep program does not save."""

    @property
    def seconds(self) -> float: ...

    @property
    def during(self) -> tuple[tuple[Op, int], ...]:
        """Ops whose own working set it shrinks, and by how many bytes (while that op runs)."""

    @property
    def copy(self) -> float:
        """Seconds of each of its two copies (forward, backward) that a copy engine runs beside the
        kernels; ``seconds`` counts them whole."""


def freed_at(graph: Graph, est: MemoryEstimate, budget: int, ways: Sequence[Way]) -> tuple[np.ndarray, np.ndarray]:
    """``(freed, excess)``: for each group of points where the estimate ``est`` of ``graph`` exceeds
    ``budget``, the bytes each way frees there (a row of ``freed``) and the group's largest excess."""
    assert graph.mesh is not None
    over = np.array([est.resident + during - budget for _, during in est.timeline], dtype=np.float64)
    points = np.flatnonzero(over > 0)
    if not len(points):
        return np.zeros((0, len(ways))), np.zeros(0)
    schedule = [op for op in graph.ops if op.prov.phase == "fwd"] + [op for op in graph.ops if op.prov.phase != "fwd"]
    forward = sum(op.prov.phase == "fwd" for op in graph.ops)
    at = {op: k for k, op in enumerate(schedule)}
    gone: dict[Value, int] = {}
    uses: dict[Value, list[int]] = {}
    for k, op in enumerate(schedule):
        for r in op.results:
            gone[r] = k + 1
        for u in op.operands:
            if k < forward:
                gone[u] = k + 1
            else:
                uses.setdefault(u, []).append(k)
    root = alias_roots(graph)
    made_fwd = {r for op in schedule[:forward] for r in op.results}
    holders: dict[Value, set[Value]] = {}  # NOTE: the saved values that keep each storage alive
    for v in uses:
        if v in made_fwd:
            holders.setdefault(root[v], set()).add(v)
    held = {root[i.value] for i in graph.inputs} | {root[o.value] for o in graph.outputs}
    nbytes = {r: local_nbytes(r, graph.mesh) for r in {root[v] for w in ways for v in (*w.values, *w.adds)}}
    freed = np.zeros((len(points), len(ways)))
    for j, w in enumerate(ways):
        back = min((min(uses[v]) for v in w.values if v in uses), default=len(schedule))
        added = {root[u] for u in w.adds}
        for r, vs in _by_root(w.values, root).items():
            # NOTE: the storage stays where another saved value, or what the way adds, still holds it
            if r in added or r in held or not holders.get(r, set()) <= vs:
                continue
            start, after = max(gone[v] for v in vs), max(max(uses[v]) for v in vs)
            freed[:, j] += nbytes[r] * (((points >= start) & (points < back)) | (points > after))
        for r, us in _by_root(w.adds, root).items():
            if r not in held and r not in holders:
                freed[:, j] -= nbytes[r] * ((points >= min(gone[u] for u in us)) & (points < back))
        for op, n in w.during:
            freed[:, j] += n * (points == at[op])
    groups, inverse = np.unique(freed, axis=0, return_inverse=True)
    excess = np.zeros(len(groups))
    np.maximum.at(excess, inverse.ravel(), over[points])
    return groups, excess


def _by_root(values: frozenset[Value], root: dict[Value, Value]) -> dict[Value, set[Value]]:
    out: dict[Value, set[Value]] = {}
    for v in values:
        out.setdefault(root[v], set()).add(v)
    return out


def cheapest(
    ways: Sequence[Way], freed: np.ndarray, excess: np.ndarray, windows: tuple[float, float] = (0.0, 0.0)
) -> list[int] | None:
    """Indices of the ways, no value freed by two, freeing at least ``excess`` at every group of
    points, in least time (HiGHS); None if no such choice exists. A way's copies (``Way.copy``) are
    priced by what the copy engine cannot hide: in each phase, their sum beyond that phase's compute
    seconds (``windows``: forward, backward), one continuous variable per phase."""
    n = len(ways)
    if not len(excess):
        return []
    if not n:
        return None
    scaled = freed / excess[:, None]  # NOTE: every row then reads "at least 1"
    r_idx, c_idx = np.nonzero(scaled)
    rows: list[int] = [int(r) for r in r_idx]
    cols: list[int] = [int(c) for c in c_idx]
    vals: list[float] = [float(x) for x in scaled[r_idx, c_idx]]
    covers: dict[Value | Op, list[int]] = {}  # NOTE: at most one way per value, and per op shrunk
    for j, w in enumerate(ways):
        claimed: list[Value | Op] = [*w.values, *(op for op, _ in w.during)]
        for v in claimed:
            covers.setdefault(v, []).append(j)
    exclusive = list(dict.fromkeys(tuple(js) for js in covers.values() if len(js) > 1))
    base = len(excess)
    for e, js in enumerate(exclusive):
        rows += [base + e] * len(js)
        cols += js
        vals += [1.0] * len(js)
    # NOTE: per phase: sum of the chosen copies - exposed <= the phase's compute seconds
    copies = [j for j, w in enumerate(ways) if w.copy > 0]
    height = base + len(exclusive)
    for p in range(2 if copies else 0):
        rows += [height + p] * (len(copies) + 1)
        cols += [*copies, n + p]
        vals += [*(ways[j].copy for j in copies), -1.0]
    phases = 2 if copies else 0
    matrix = csc_array((vals, (rows, cols)), shape=(height + phases, n + phases))
    # NOTE: a floor on each way's time keeps free-looking ones (no FLOPs the model prices) from
    # being taken for nothing
    cost = [max(w.seconds - 2 * w.copy, 1e-12) for w in ways] + [1.0] * phases
    lo = [1.0] * base + [0.0] * len(exclusive) + [-float("inf")] * phases
    hi = [float("inf")] * base + [1.0] * len(exclusive) + list(windows[:phases])
    answer = solve_milp(
        cost,
        [0.0] * (n + phases),
        [1.0] * n + [float("inf")] * phases,
        [1] * n + [0] * phases,
        matrix,
        lo,
        hi,
        gap=1e-6,
        node_limit=10_000,
    )
    if answer.x is None:
        return None
    return [j for j, x in enumerate(answer.x[:n]) if x > 0.5]
