"""A byte budget per rank: which saved activations to keep, recompute or offload, in least time.

The ways to free memory (``choices``): per block (``layers.3``), recompute its pointwise ops (all
but GEMMs, attention and collectives: cheap to run again, from the values kept for those) or the
whole block from its input; per saved activation, offload it to the host tier. A way adds time:
the recomputed ops' price under the one time model (``passes.cost.axis``), or an offload's copies
there and back at the device's host bandwidth (``Device.host_bw``). Where the core makes the copies
(CPU ranks) they are counted whole. A device with a copy engine runs them beside its kernels (the
overlap pass starts each reload just in time for its reader), so there the program prices only
what the copy engine cannot hide: per phase, the chosen copies' seconds beyond the phase's compute
seconds (``copy_windows``). The sharding solve's prices (``spill_prices``) count copies whole.

An integer program (HiGHS, ``rows``) takes at most one way per value with least added time such
that at every point of the schedule the predicted peak exceeds the budget, what the ways free there
covers the excess. The program's picture of where each value lives is exact for one way at a time;
a recomputed chain is made in one go before the first backward reader of any of it, so some values
come back earlier than it assumes. So the choice is carried out, the peak predicted again by the
liveness estimate (``passes.cost.liveness``), and while it is still over, the excess is added to
every row and the program solved again: an outer loop with exact feedback, as between the sharding
solve and this pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from meshfold.ir import Graph, Mesh, Op, Value
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD, ROWS, with_rows
from meshfold.ir.dialects.moe_memory import pieces, working_set
from meshfold.ir.graph import local_nbytes
from meshfold.passes.blocks import op_blocks
from meshfold.passes.cost.axis import axis_models
from meshfold.passes.cost.liveness import alias_roots, rank_memory
from meshfold.passes.memory.offload import offloaded, saved_activations
from meshfold.passes.memory.policies import policy_values
from meshfold.passes.memory.recompute import recompute
from meshfold.passes.memory.rows import cheapest, freed_at
from meshfold.passes.schedule.timeline import Costs
from meshfold.target.hardware import Cluster

ROUNDS = 8
"""Solves at most: each adds the excess the estimate still shows (two sufficed on the test models)."""

MARGIN = 0.02
"""Share of the budget left free: the liveness estimate measured within 1% of the allocator's peak
on the rank tests, either side; a program filling its budget to the byte measured 0.5% over."""


@dataclass(frozen=True)
class Choice:
    """One way to free memory: ``how`` is ``pointwise`` or ``full`` (recompute a block's ops), or
    ``offload`` (one saved activation)."""

    block: str
    """``layers.3``; ``""``: outside every block (the logits, the loss's inputs)."""
    how: str
    again: frozenset[Value]
    """Values recomputed."""
    values: frozenset[Value]
    """The saved activations it frees (the forward no longer hands them to the backward)."""
    adds: frozenset[Value]
    """What its recompute makes the backward read that the keep program does not save."""
    freed: int
    """Their bytes per rank."""
    seconds: float
    """Time the choice adds to a step on one rank."""
    during: tuple[tuple[Op, int], ...] = ()
    """``pieces``: the routed-experts op it shrinks and the bytes that frees while the op runs."""
    rows: int = 0
    """``pieces``: the pairs the op then computes at a time."""
    copy: float = 0.0
    """``offload`` on a device with a copy engine: seconds of each of its two copies, which that engine
    runs beside the kernels (``seconds`` counts both whole)."""

    @property
    def offloads(self) -> bool:
        return self.how == "offload"

    @property
    def label(self) -> str:
        where = self.block or "outside the blocks"
        if self.how == "pieces":
            return f"{where} experts {self.during[0][0].prov.phase} in pieces of {self.rows}"
        return where if self.how == "full" else f"{where} {self.how}"


@dataclass(frozen=True)
class Decision:
    """The choices a budget took, and the graph that carries them out."""

    chosen: tuple[Choice, ...]
    graph: Graph
    offloaded: tuple[str, ...] = ()
    """Names of the values offloaded."""

    @property
    def recomputed(self) -> list[str]:
        return [c.label for c in self.chosen if c.how in ("pointwise", "full")]

    @property
    def pieces(self) -> list[str]:
        return [c.label for c in self.chosen if c.how == "pieces"]


def choices(graph: Graph, cluster: Cluster | None) -> list[Choice]:
    """Every way to free memory, with the bytes it frees and the time it adds."""
    mesh = graph.mesh
    assert mesh is not None
    costs = Costs(graph, axis_models(mesh, cluster))
    host_bw = costs.models[0].cluster.device.host_bw
    saved = frozenset(saved_activations(graph, min_bytes=0))
    made = {r: op for op in graph.ops for r in op.results}
    out: list[Choice] = []
    for how in ("pointwise", "full"):
        for b, vs in sorted(policy_values(graph, how).items()):
            frees = frozenset(vs).intersection(saved)
            seconds = sum(costs.compute(op) for op in {made[v] for v in vs})
            adds = _adds(frozenset(vs), saved, made)
            out.append(Choice(b, how, frozenset(vs), frees, adds, _nbytes(frees, mesh), seconds))
    block = _value_blocks(graph)
    root = alias_roots(graph)
    shared: dict[Value, list[Value]] = {}  # NOTE: saved values that share one storage go together
    for v in saved_activations(graph):
        shared.setdefault(root[v], []).append(v)
    for group in shared.values():
        n = _nbytes(group, mesh)
        away, copy = frozenset(group), n / host_bw if costs.copy_engine else 0.0
        out.append(
            Choice(block.get(group[0], ""), "offload", frozenset(), away, frozenset(), n, 2 * n / host_bw, copy=copy)
        )
    launch = max(costs.models[0].cluster.device.eff.launch_s, DISPATCH_S)
    for op, b in zip(graph.ops, op_blocks(graph), strict=True):
        if op.target not in KERNELS:
            continue
        for rows in SMALLER:
            n = working_set(op, mesh) - working_set(with_rows(op, rows), mesh)
            more = pieces(op, mesh, rows) - pieces(op, mesh)
            seconds = more * KERNELS[op.target] * launch
            none = frozenset[Value]()
            out.append(Choice(b, "pieces", none, none, none, n, seconds, ((op, n),), rows))
    return [c for c in out if c.freed > 0]


SMALLER = (ROWS // 2, ROWS // 4, ROWS // 8)
"""Piece sizes a budget may give a routed-experts op (``ir.dialects.moe.piece_rows``): its working set is one
piece of one expert's temporaries, so halving the piece halves most of it, for more kernels."""

KERNELS = {EXPERTS: 8, EXPERTS_BACKWARD: 24}
"""Kernels one piece launches (``ir.dialects.moe.pair_outputs``, ``pair_grads``): what a smaller piece adds."""

DISPATCH_S = 1.5e-6
"""Least time an extra kernel adds: one eager op's dispatch, measured on this CPU (one thread,
tiny tensors), where the device's model prices no launch gap (``hardware.HOST``)."""


def copy_windows(graph: Graph, cluster: Cluster | None) -> tuple[float, float]:
    """Seconds of compute in the forward and in the backward of ``graph`` on one rank: how long a
    copy engine can copy beside the kernels of each phase."""
    assert graph.mesh is not None
    costs = Costs(graph, axis_models(graph.mesh, cluster))
    return (
        sum(costs.compute(op) for op in graph.ops if op.prov.phase == "fwd"),
        sum(costs.compute(op) for op in graph.ops if op.prov.phase != "fwd"),
    )


def spill_prices(graph: Graph, mesh: Mesh, cluster: Cluster | None) -> tuple[tuple[float, float], ...]:
    """What freeing saved activations costs, as the sharding solve sees it before any layout is
    chosen: ``(seconds per byte, share)`` stretches, cheapest first, where ``share`` is the fraction
    of all the bytes the forward hands to the backward that this pass can free at that price.

    Priced on the whole (unsplit) graph: splitting an op over ranks divides its FLOPs and its
    results alike, so seconds per byte freed do not depend on the layouts. Per block, its ways
    combined (each recompute alone or with the offload of what it leaves saved, or everything
    offloaded), on the lower convex hull of bytes freed against time added: a combination with
    fewer bytes and more time is never worth taking. Those hull edges from every block, merged by
    price. On a device with a copy engine, offloads whose copies fit in each phase's compute time
    (``copy_windows``) add none: the first stretch, at price 0, is the share of the saved bytes
    those copies move; the hull's cheapest edges price the rest."""
    g = replace(graph, mesh=mesh)
    total = _nbytes(saved_activations(g, min_bytes=0), mesh)
    if not total:
        return ()
    hidden = 0.0
    if Costs(g, axis_models(mesh, cluster)).copy_engine:
        # NOTE: unsplit, the windows and the bytes are the whole graph's; layouts divide both alike
        bw = axis_models(mesh, cluster)[0].cluster.device.host_bw
        hidden = min(min(copy_windows(g, cluster)) * bw / total, 1.0)
    edges: dict[float, float] = {}
    spills = [c for c in choices(g, cluster) if c.how != "pieces"]
    for points in _block_points(spills).values():
        at = (0, 0.0)
        while True:
            ahead = [(b - at[0], t - at[1]) for b, t in points if b > at[0]]
            if not ahead:
                break
            step = min(ahead, key=lambda e: (e[1] / e[0], -e[0]))  # NOTE: the hull's next edge
            rate = float(f"{max(step[1], 0.0) / step[0]:.9g}")  # NOTE: equal blocks' edges merge
            edges[rate] = edges.get(rate, 0) + step[0]
            at = (at[0] + step[0], at[1] + step[1])
    if hidden > 0:
        edges[0.0] = edges.get(0.0, 0) + hidden * total
    out, share = [], 0.0
    for rate in sorted(edges):
        part = min(edges[rate] / total, 1.0 - share)
        if part > 0:
            out.append((rate, part))
            share += part
    return tuple(out)


def _block_points(options: list[Choice]) -> dict[str, list[tuple[int, float]]]:
    """Per block, (bytes freed, seconds added) of: each recompute; each recompute with the offload
    of the block's values it leaves saved; every value offloaded."""
    out: dict[str, list[tuple[int, float]]] = {}
    for b in sorted({c.block for c in options}):
        here = [c for c in options if c.block == b]
        moved = [c for c in here if c.offloads]
        points = [(sum(c.freed for c in moved), sum(c.seconds for c in moved))]
        for r in (c for c in here if not c.offloads):
            rest = [c for c in moved if not c.values <= r.values]
            points.append((r.freed, r.seconds))
            points.append((r.freed + sum(c.freed for c in rest), r.seconds + sum(c.seconds for c in rest)))
        out[b] = [p for p in points if p[0] > 0]
    return out


def decide(graph: Graph, budget: int, cluster: Cluster | None) -> Decision:
    """The least-time choices that bring the predicted peak under ``budget``; when none do, those
    that free the most (the caller reports the peak they reach)."""
    est = rank_memory(graph, cluster=cluster)
    if est.peak <= budget:
        return Decision((), graph)
    budget -= int(MARGIN * budget)
    options = choices(graph, cluster)
    freed, excess = freed_at(graph, est, budget, options)
    windows = copy_windows(graph, cluster)
    # NOTE: ``more`` is added to every row's excess: raised by what a pick still left over; where that
    # makes the program infeasible, halved back towards the last feasible one
    more, low, high = 0.0, 0.0, math.inf
    for _ in range(ROUNDS):
        picked = cheapest(options, freed, excess + more, windows)
        if picked is None:
            high = more
            more = (low + high) / 2
        else:
            best = carry_out(graph, tuple(options[j] for j in picked))
            over = rank_memory(best.graph, cluster=cluster).peak - budget
            if over <= 0:
                return _larger_pieces(graph, best, budget, cluster)
            low = more
            more = low + over if low + over < high else (low + high) / 2
        if high - low < 1:
            break
    return _most(graph, options, cluster)


def _larger_pieces(graph: Graph, decision: Decision, budget: int, cluster: Cluster | None) -> Decision:
    """``decision`` with each routed-experts op back in the largest pieces that still meet ``budget``:
    the program's rows ask every way for the feedback's added excess, so it may shrink pieces the
    carried-out program does not need shrunk (fewer kernels for the same bytes)."""
    for c in [c for c in decision.chosen if c.how == "pieces"]:
        for rows in (ROWS, *SMALLER):
            if rows <= c.rows:
                break
            rest = tuple(d for d in decision.chosen if d is not c)
            wider = rest if rows == ROWS else (*rest, replace(c, rows=rows))
            tried = carry_out(graph, wider)
            if rank_memory(tried.graph, cluster=cluster).peak <= budget:
                decision = tried
                break
    return decision


def carry_out(graph: Graph, chosen: tuple[Choice, ...]) -> Decision:
    """``graph`` with the chosen experts' pieces, then the chosen recomputes, then the chosen values
    offloaded."""
    rows = {op: c.rows for c in chosen for op, _ in c.during}
    if rows:
        graph = replace(graph, ops=tuple(with_rows(op, rows[op]) if op in rows else op for op in graph.ops))
    again = set().union(*(c.again for c in chosen))
    out = recompute(graph, again) if again else graph
    away = set().union(*(c.values for c in chosen if c.offloads))
    if not away:
        return Decision(chosen, out)
    moved = [v for v in saved_activations(out) if v in away]
    return Decision(chosen, offloaded(out, moved), tuple(sorted(v.name for v in moved)))


def _most(graph: Graph, options: list[Choice], cluster: Cluster | None) -> Decision:
    """The lowest predicted peak of one way for every block (every value offloaded; every block
    recomputed pointwise or whole, alone or with every value still saved then offloaded): what the
    caller reports when no choice meets the budget; each with the routed experts in their smallest
    pieces."""
    least = tuple(c for c in options if c.how == "pieces" and c.rows == SMALLER[-1])
    tried = [carry_out(graph, (*least, *(c for c in options if c.offloads)))]
    for how in ("pointwise", "full"):
        again = (*least, *(c for c in options if c.how == how))
        d = carry_out(graph, again)
        rest = saved_activations(d.graph)
        tried += [d, Decision(again, offloaded(d.graph, rest), tuple(sorted(v.name for v in rest)))]
    return min(tried, key=lambda d: rank_memory(d.graph, cluster=cluster).peak)


def _adds(again: frozenset[Value], saved: frozenset[Value], made: dict[Value, Op]) -> frozenset[Value]:
    """What recomputing ``again`` makes the backward read that the keep program does not save: the
    operands of the ops it runs again (those the backward reads, and the chosen values they read),
    neither chosen nor saved."""
    todo = [v for v in again if v in saved]
    seen: set[Value] = set()
    out: set[Value] = set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        for u in made[v].operands:
            if u in again:
                todo.append(u)
            elif u not in saved and u in made:
                out.add(u)
    return frozenset(out)


def _value_blocks(graph: Graph) -> dict[Value, str]:
    """The block of each op's results (``blocks.op_blocks``)."""
    return {r: b for op, b in zip(graph.ops, op_blocks(graph), strict=True) for r in op.results}


def _nbytes(values: Iterable[Value], mesh: Mesh) -> int:
    return sum(local_nbytes(v, mesh) for v in values)
