"""A byte budget per rank: for each block, keep, recompute or offload, whichever adds least time.

Each block (``layers.3``) has four choices: keep everything; recompute its pointwise ops (all but
GEMMs, attention and collectives: cheap to run again); recompute the whole block from its input;
offload every saved activation it makes to the host tier. A choice frees the bytes the forward no
longer hands to the backward and adds time: the recomputed ops' price under the one time model
(``passes.cost.axis``), or an offload's copies there and back at the device's host bandwidth
(``Device.host_bw``), counted whole (a reload is not yet issued ahead of its reader, so nothing
hides it).

An integer program (HiGHS) picks one choice per block with least added time such that the bytes
freed cover the predicted peak's excess over the budget. Bytes freed do not lower the peak one for
one (a recomputed block's values live again for a while in the backward; the peak may move), so
the choice is applied, the peak predicted again by the liveness estimate (``passes.cost.memory``),
and while it is still over, the excess is added to what must be freed and the program solved
again: an outer loop with exact feedback, as between the sharding solve and this pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scipy.sparse import csc_array

from meshfold.ir import Graph, Mesh, Value
from meshfold.ir.graph import local_nbytes
from meshfold.passes.blocks import op_blocks
from meshfold.passes.cost.axis import axis_models
from meshfold.passes.cost.hardware import Cluster
from meshfold.passes.cost.memory import rank_memory
from meshfold.passes.memory.offload import offloaded, saved_activations
from meshfold.passes.memory.policies import policy_values
from meshfold.passes.memory.recompute import recompute
from meshfold.passes.schedule.timeline import Costs
from meshfold.passes.sharding.milp import solve_milp

ROUNDS = 8
"""Solves at most: each adds the excess the estimate still shows (two sufficed on the test models)."""


@dataclass(frozen=True)
class Choice:
    """One way to lighten one block: ``how`` is ``pointwise`` or ``full`` (recompute),
    ``offload``, or ``full+offload`` (recompute the block and offload what it still hands over: its
    output, the next block's input)."""

    block: str
    """``layers.3``; ``""``: the ops outside every block (offload only)."""
    how: str
    again: frozenset[Value]
    """Values recomputed."""
    freed: int
    """Bytes per rank the forward no longer hands to the backward."""
    seconds: float
    """Time the choice adds to a step on one rank."""

    @property
    def offloads(self) -> bool:
        return self.how.endswith("offload")

    @property
    def label(self) -> str:
        where = self.block or "outside the blocks"
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
        return [c.label for c in self.chosen if c.how != "offload"]


def choices(graph: Graph, cluster: Cluster | None) -> list[Choice]:
    """Every block's ways to free memory, with their bytes freed and time added."""
    mesh = graph.mesh
    assert mesh is not None
    costs = Costs(graph, axis_models(mesh, cluster))
    host_bw = costs.models[0].cluster.device.host_bw
    read = {u for op in graph.ops if op.prov.phase == "bwd" for u in op.operands}
    made = {r: op for op in graph.ops for r in op.results}
    out: list[Choice] = []
    full: dict[str, Choice] = {}
    for how in ("pointwise", "full"):
        for b, vs in sorted(policy_values(graph, how).items()):
            freed = sum(local_nbytes(v, mesh) for v in vs if v in read)
            seconds = sum(costs.compute(op) for op in {made[v] for v in vs})
            out.append(Choice(b, how, frozenset(vs), freed, seconds))
            if how == "full":
                full[b] = out[-1]
    # NOTE: offload also takes what no block makes (the logits and the loss's inputs, the embedding's
    # output), which no recompute policy covers
    kept = _saved_bytes(graph)
    for b, nbytes in sorted(kept.items()):
        out.append(Choice(b, "offload", frozenset(), nbytes, 2 * nbytes / host_bw))
    if full:
        rest = _saved_bytes(recompute(graph, set().union(*(c.again for c in full.values()))))
        for b, c in sorted(full.items()):
            sent = rest.get(b, 0)
            out.append(Choice(b, "full+offload", c.again, c.freed + sent, c.seconds + 2 * sent / host_bw))
    return [c for c in out if c.freed > 0]


def spill_prices(graph: Graph, mesh: Mesh, cluster: Cluster | None) -> tuple[tuple[float, float], ...]:
    """What freeing saved activations costs, as the sharding solve sees it before any layout is
    chosen: ``(seconds per byte, share)`` stretches, cheapest first, where ``share`` is the fraction
    of all the bytes the forward hands to the backward that this pass can free at that price.

    Priced on the whole (unsplit) graph: splitting an op over ranks divides its FLOPs and its
    results alike, so seconds per byte freed do not depend on the layouts. Per block, the choices
    (``choices``) on the lower convex hull of bytes freed against time added: one with fewer bytes
    and more time is never worth taking. Those hull edges from every block, merged by price."""
    g = replace(graph, mesh=mesh)
    fwd = {r for op in g.ops if op.prov.phase == "fwd" for r in op.results}
    read = {u for op in g.ops if op.prov.phase == "bwd" for u in op.operands}
    total = sum(local_nbytes(v, mesh) for v in fwd & read)
    if not total:
        return ()
    per_block: dict[str, list[tuple[int, float]]] = {}
    for c in choices(g, cluster):
        per_block.setdefault(c.block, []).append((c.freed, c.seconds))
    edges: dict[float, int] = {}
    for points in per_block.values():
        at = (0, 0.0)
        while True:
            ahead = [(b - at[0], t - at[1]) for b, t in points if b > at[0]]
            if not ahead:
                break
            step = min(ahead, key=lambda e: (e[1] / e[0], -e[0]))  # NOTE: the hull's next edge
            rate = float(f"{max(step[1], 0.0) / step[0]:.9g}")  # NOTE: equal blocks' edges merge
            edges[rate] = edges.get(rate, 0) + step[0]
            at = (at[0] + step[0], at[1] + step[1])
    out, share = [], 0.0
    for rate in sorted(edges):
        part = min(edges[rate] / total, 1.0 - share)
        if part > 0:
            out.append((rate, part))
            share += part
    return tuple(out)


def decide(graph: Graph, budget: int, cluster: Cluster | None) -> Decision:
    """The least-time choices that bring the predicted peak under ``budget``; when none do, those
    that free the most (the caller reports the peak they reach)."""
    peak = rank_memory(graph, cluster=cluster).peak
    if peak <= budget:
        return Decision((), graph)
    options = choices(graph, cluster)
    need = peak - budget
    for _ in range(ROUNDS):
        picked = _cheapest(options, need)
        if picked is None:
            break
        best = carry_out(graph, picked)
        over = rank_memory(best.graph, cluster=cluster).peak - budget
        if over <= 0:
            return best
        need += over
    return _most(graph, options, cluster)


def carry_out(graph: Graph, chosen: tuple[Choice, ...]) -> Decision:
    """``graph`` with the chosen recomputes, then the chosen blocks' saved activations offloaded."""
    again = set().union(*(c.again for c in chosen))
    out = recompute(graph, again) if again else graph
    away = {c.block for c in chosen if c.offloads}
    if not away:
        return Decision(chosen, out)
    block = _value_blocks(out)
    moved = [v for v in saved_activations(out) if block.get(v, "") in away]
    return Decision(chosen, offloaded(out, moved), tuple(sorted(v.name for v in moved)))


def _cheapest(options: list[Choice], need: int) -> tuple[Choice, ...] | None:
    """At most one choice per block, freeing at least ``need`` bytes in least time (HiGHS); None if
    even all blocks' largest choices free less."""
    blocks = sorted({c.block for c in options})
    if sum(max(c.freed for c in options if c.block == b) for b in blocks) < need:
        return None
    row = {b: k + 1 for k, b in enumerate(blocks)}
    rows, cols, vals = [], [], []
    for j, c in enumerate(options):
        rows += [0, row[c.block]]
        cols += [j, j]
        vals += [c.freed / need, 1.0]
    n = len(options)
    matrix = csc_array((vals, (rows, cols)), shape=(len(blocks) + 1, n))
    # NOTE: a floor on the time of each choice keeps free-looking choices (a block with no FLOPs the
    # model prices) from being taken for nothing: the least bytes moved wins among them
    cost = [max(c.seconds, 1e-12) for c in options]
    answer = solve_milp(
        cost,
        [0.0] * n,
        [1.0] * n,
        [1] * n,
        matrix,
        [1.0] + [0.0] * len(blocks),
        [float("inf")] + [1.0] * len(blocks),
        gap=1e-6,
        node_limit=10_000,
    )
    if answer.x is None:
        return None
    return tuple(c for c, x in zip(options, answer.x, strict=True) if x > 0.5)


def _most(graph: Graph, options: list[Choice], cluster: Cluster | None) -> Decision:
    """The lowest predicted peak of one way for every block (each block offloaded, recomputed, or
    both): what the caller reports when no choice meets the budget."""
    hows = sorted({c.how for c in options})
    tried = []
    for how in hows:
        picked = tuple(c for c in options if c.how == how or (c.how == "offload" and not c.block))
        tried.append(carry_out(graph, picked))
    return min(tried, key=lambda d: rank_memory(d.graph, cluster=cluster).peak)


def _value_blocks(graph: Graph) -> dict[Value, str]:
    """The block of each op's results (``blocks.op_blocks``)."""
    return {r: b for op, b in zip(graph.ops, op_blocks(graph), strict=True) for r in op.results}


def _saved_bytes(graph: Graph) -> dict[str, int]:
    """Per block, the bytes of the saved activations it makes (``offload.saved_activations``)."""
    assert graph.mesh is not None
    block = _value_blocks(graph)
    out: dict[str, int] = {}
    for v in saved_activations(graph):
        b = block.get(v, "")
        out[b] = out.get(b, 0) + local_nbytes(v, graph.mesh)
    return out
