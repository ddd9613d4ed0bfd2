"""``memory``: which activations each rank keeps for the backward, recomputes, or offloads.

Policies (``memory{policy=...}`` or ``parallelize(..., memory="...")``):

* ``full``: every block (``layers.3``: ``blocks.op_blocks``) recomputed from its input;
  ``selective``: the core of each attention (rotary, the K/V repeat, the kernel) from the Q/K/V
  projections; ``kv``: only the key and value path, from the projections' input
  (``policies``). The forward hands the backward none of what they choose; those ops run again
  right before the backward reads their results (``recompute``). What cannot run twice (a random
  draw) is always kept.
* ``offload``: every saved activation goes to the host tier after its last forward use and comes
  back before its first backward use (``offload``; ``backends/offload.py`` lowers the pair).
* a byte budget (``memory{budget=6GiB}``, ``memory="6GiB"``): the fewest recompute units that bring
  the predicted peak of one rank (``passes.cost.memory``: parameters, gradients, optimizer state,
  live activations) under it; first each block's pointwise ops (all but GEMMs, attention and
  collectives), then whole blocks, within each stage the units that free the most saved bytes per
  second of recompute first (the one time model's price of their forward ops).
* ``keep`` (the default without a budget): everything kept.

A budget that the parameter state alone, or the program with every block recomputed, exceeds
fails before anything runs, saying how many bytes are needed and the largest parameter.
``PassContext.stats["memory"]``: the policy, budget, predicted peak before and after, the units
recomputed or the values offloaded, and the predicted seconds the recompute adds per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from meshfold.ir import Graph, Value
from meshfold.ir.graph import local_nbytes
from meshfold.ir.ops import WAIT
from meshfold.passes.base import Pass, PassContext, PassError
from meshfold.passes.cost.axis import axis_models
from meshfold.passes.cost.memory import rank_memory, size_text
from meshfold.passes.memory.offload import offloaded, saved_activations
from meshfold.passes.memory.policies import policy_values
from meshfold.passes.memory.recompute import recompute
from meshfold.passes.schedule.overlap import SCHEDULED
from meshfold.passes.schedule.timeline import Costs
from meshfold.passes.sharding.boxing import BOXED

Policy = Literal["auto", "keep", "full", "selective", "kv", "offload"]


@dataclass(frozen=True)
class Memory(Pass):
    """Keep or recompute each block's activations (``memory{policy=auto,budget=0}``)."""

    name: ClassVar[str] = "memory"
    requires: ClassVar[frozenset[str]] = frozenset({BOXED})
    ensures: ClassVar[frozenset[str]] = frozenset()
    invalidates: ClassVar[frozenset[str]] = frozenset({SCHEDULED})
    policy: Policy = "auto"
    """``auto``: the compilation's (``parallelize(memory="full")``), else recompute only what the
    budget needs; ``keep``; ``full``, ``selective``, ``kv`` (``policies``); ``offload``."""
    budget: int = 0
    """Bytes per rank (0: the compilation's ``memory`` bound, if any)."""

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        policy = self.policy if self.policy != "auto" else (ctx.memory_policy or "auto")
        budget = self.budget or ctx.memory or 0
        if graph.mesh is None or (policy in ("auto", "keep") and not budget):
            return graph
        if any(op.target == WAIT for op in graph.ops):
            raise PassError("the memory pass runs before overlap (it decides what overlap then schedules)")
        before = rank_memory(graph)
        chosen, out = _decide(graph, policy, budget, before.peak)
        after = rank_memory(out)
        if budget and after.peak > budget:
            how = f"under policy {policy}"
            if policy == "auto":
                how = "with every block recomputed" if chosen else "with nothing (no block, layers.N) to recompute"
            _over_budget(graph, budget, after.peak, after.resident, how)
        assert graph.mesh is not None
        costs = Costs(out, axis_models(graph.mesh, ctx.cluster))
        made = {r for op in graph.ops for r in op.results}
        added = sum(costs.compute(op) for op in out.ops if op.prov.phase == "bwd" and not set(op.results) <= made)
        ctx.stats["memory"] = {
            "policy": policy,
            "budget": budget,
            "peak_before": before.peak,
            "peak_after": after.peak,
            "recomputed": [] if policy == "offload" else chosen,
            "offloaded": chosen if policy == "offload" else [],
            "recompute_s": added,
        }
        return out


def _decide(graph: Graph, policy: str, budget: int, peak: int) -> tuple[list[str], Graph]:
    """What ``policy`` recomputes (blocks, or the units a budget needs) or offloads (values), and the
    graph that does it."""
    if policy == "keep":
        return [], graph
    if policy == "offload":
        moved = saved_activations(graph)
        return [v.name for v in moved], offloaded(graph, moved)
    if policy == "auto":
        names, values = _fewest(graph, budget, peak)
    else:
        parts = policy_values(graph, policy)
        names, values = list(parts), set().union(*parts.values())
    return names, recompute(graph, values) if values else graph


def _fewest(graph: Graph, budget: int, peak: int) -> tuple[list[str], set[Value]]:
    """The shortest prefix of the recompute units whose recompute brings the predicted peak under
    ``budget`` (all of them when none does: the caller says so), and its values. Units: first each
    block's pointwise ops (everything but GEMMs, attention and collectives: cheap to run again),
    then each whole block; within each stage, best saving per recompute second first. Each prefix
    recomputes more than the one before, so the peak falls along them and bisection finds it."""
    if peak <= budget:
        return [], set()
    assert graph.mesh is not None
    costs = Costs(graph, axis_models(graph.mesh, None))
    read = {u for op in graph.ops if op.prov.phase == "bwd" for u in op.operands}
    made = {r: op for op in graph.ops for r in op.results}
    units: list[tuple[str, set[Value]]] = []
    for stage, suffix in (("pointwise", " pointwise"), ("full", "")):
        parts = policy_values(graph, stage)
        freed = {b: sum(local_nbytes(v, graph.mesh) for v in vs if v in read) for b, vs in parts.items()}
        seconds = {b: sum(costs.compute(op) for op in {made[v] for v in vs}) for b, vs in parts.items()}
        order = sorted(parts, key=lambda b: (-freed[b] / max(seconds[b], 1e-12), b))
        units += [(b + suffix, parts[b]) for b in order]

    def values(k: int) -> set[Value]:
        return set().union(*(vs for _, vs in units[:k]))

    def fits(k: int) -> bool:
        est = rank_memory(recompute(graph, values(k)))
        return est.peak <= budget

    lo, hi = 1, len(units)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return [name for name, _ in units[:lo]], values(lo)


def _over_budget(graph: Graph, budget: int, peak: int, resident: int, how: str) -> None:
    assert graph.mesh is not None
    params = [i for i in graph.inputs if i.kind in ("param", "buffer")]
    big = max(params, key=lambda i: local_nbytes(i.value, graph.mesh), default=None)
    largest = ""
    if big is not None:
        largest = f"; the largest parameter on a rank: {big.name} ({size_text(local_nbytes(big.value, graph.mesh))})"
    if resident > budget:
        raise PassError(
            f"memory budget {size_text(budget)} per rank is below the parameter state alone ({size_text(resident)}: "
            f"parameters, gradients and optimizer state){largest}; shard the parameters over more ranks "
            "(plan='fsdp' or 'fsdp+tp') or raise the budget"
        )
    raise PassError(
        f"memory budget {size_text(budget)} per rank cannot be met: {how} the predicted peak is {size_text(peak)}, "
        f"{size_text(peak - budget)} over{largest}; shard more or raise the budget"
    )
