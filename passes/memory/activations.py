"""``memory``: which activations each rank keeps for the backward, recomputes, or offloads.

Policies (``memory{policy=...}`` or ``parallelize(..., memory="...")``):

* ``full``: every block (``layers.3``: ``blocks.op_blocks``) recomputed from its input;
  ``selective``: the core of each attention (rotary, the K/V repeat, the kernel) from the Q/K/V
  projections; ``kv``: only the key and value path, from the projections' input
  (``policies``). The forward hands the backward none of what they choose; those ops run again
  right before the backward reads their results (``recompute``). What cannot run twice (a random
  draw) is always kept.
* ``offload``: every saved activation goes to the host tier after its last forward use and comes
  back before its first backward use (``offload``; ``backends/host_tier.py`` lowers the pair).
* a byte budget (``memory{budget=6GiB}``, ``memory="6GiB"``): per block, recompute its pointwise
  ops or all of it; per saved activation, offload it; per routed-experts op, compute it in smaller
  pieces (``ir.dialects.moe.piece_rows``: a smaller working set, more kernels), whichever ways bring the predicted
  memory of one rank (``passes.cost.liveness``: parameters, gradients, optimizer state, live
  activations) under the budget at every point of the schedule in least added time (``budget``,
  ``rows``: an integer program with exact feedback).
* ``keep`` (the default without a budget): everything kept.

A budget that the parameter state alone, or the program with every block recomputed, exceeds
fails before anything runs, saying how many bytes are needed and the largest parameter.
``PassContext.stats["memory"]``: the policy, budget, predicted peak before and after, the blocks
recomputed and the values offloaded, and the predicted seconds each adds per step (an offload's,
what the copies' seconds exceed each phase's compute by where a copy engine runs them beside the
kernels, ``budget``; all of them where the core copies).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from meshfold.ir import Graph, Value
from meshfold.ir.graph import local_nbytes
from meshfold.ir.ops import OFFLOAD, WAIT
from meshfold.passes.base import Pass, PassError
from meshfold.passes.cost.axis import axis_models
from meshfold.passes.cost.liveness import rank_memory, size_text
from meshfold.passes.memory.budget import copy_windows, decide
from meshfold.passes.memory.offload import offloaded, saved_activations
from meshfold.passes.memory.policies import ANSWERS, Saved, policy_values
from meshfold.passes.memory.recompute import overwritten_buffers, recomputable, recompute
from meshfold.passes.schedule.overlap import SCHEDULED
from meshfold.passes.schedule.timeline import Costs
from meshfold.passes.sharding.boxing import BOXED

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

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
        asked = ctx.options.memory_policy if self.policy == "auto" else None
        policy = asked if callable(asked) else self.policy if self.policy != "auto" else (asked or "auto")
        budget = self.budget or ctx.options.memory or 0
        if graph.mesh is None or (policy in ("auto", "keep") and not budget):
            return graph
        if any(op.target == WAIT for op in graph.ops):
            raise PassError("the memory pass runs before overlap (it decides what overlap then schedules)")
        if callable(policy):
            return self._per_value(ctx, graph, policy)
        before = rank_memory(graph, cluster=ctx.options.cluster)
        recomputed, moved, out, pieces = _decide(ctx, graph, policy, budget)
        after = rank_memory(out, cluster=ctx.options.cluster)
        if budget and after.peak > budget:
            how = f"under policy {policy}"
            if policy == "auto":
                how = (
                    "with every block recomputed or offloaded"
                    if recomputed or moved
                    else "with nothing (no block, layers.N) to recompute or offload"
                )
            _over_budget(graph, budget, after.peak, after.resident, how)
        self._report(ctx, graph, out, policy, budget, (before.peak, after.peak), (recomputed, moved), pieces)
        return out

    def _report(
        self,
        ctx: PassContext,
        graph: Graph,
        out: Graph,
        policy: str,
        budget: int,
        peaks: tuple[int, int],
        what: tuple[list[str], list[str]],
        pieces: list[str] | None = None,
    ) -> None:
        """``PassContext.stats["memory"]``: the decision (blocks recomputed, values offloaded, routed
        experts computed in smaller pieces), the peaks and the time it adds."""
        assert graph.mesh is not None
        costs = Costs(out, axis_models(graph.mesh, ctx.options.cluster))
        made = {r for op in graph.ops for r in op.results}
        added = sum(costs.compute(op) for op in out.ops if op.prov.phase == "bwd" and not set(op.results) <= made)
        sent = sum(local_nbytes(op.operands[0], graph.mesh) for op in out.ops if op.target == OFFLOAD)
        copy = sent / costs.models[0].cluster.device.host_bw
        # NOTE: a copy engine hides a phase's copies up to its compute seconds; a CPU rank's core copies
        windows = copy_windows(graph, ctx.options.cluster) if costs.copy_engine else (0.0, 0.0)
        ctx.stats["memory"] = {
            "policy": policy,
            "budget": budget,
            "peak_before": peaks[0],
            "peak_after": peaks[1],
            "recomputed": what[0],
            "offloaded": what[1],
            "pieces": pieces or [],
            "recompute_s": added,
            "offload_s": sum(max(copy - w, 0.0) for w in windows),
            "copies_s": 2 * copy,
        }

    def _per_value(self, ctx: PassContext, graph: Graph, ask: Callable[[Saved], str]) -> Graph:
        """``parallelize(memory=fn)``: each saved activation saved, recomputed or offloaded as ``fn``
        answers for it (``policies.Saved``)."""
        assert graph.mesh is not None
        made = {r: op for op in graph.ops for r in op.results}
        overwritten = overwritten_buffers(graph)
        again: set[Value] = set()
        away: set[Value] = set()
        for v in saved_activations(graph, min_bytes=0):
            op = made[v]
            seen = Saved(v.name, op.prov.module, op.name, local_nbytes(v, graph.mesh), recomputable(op, overwritten))
            answer = ask(seen)
            if answer not in ANSWERS:
                raise PassError(
                    f"memory policy {_name(ask)} answered {answer!r} for %{v.name}, made by {op.describe()}; "
                    f"answer one of {', '.join(ANSWERS)}"
                )
            if answer == "recompute" and not seen.recomputable:
                raise PassError(
                    f"memory policy {_name(ask)} asks to recompute %{v.name}, made by {op.describe()}, which "
                    "mutates or draws random numbers and cannot run twice; answer save or offload for it"
                )
            (again if answer == "recompute" else away if answer == "offload" else set()).add(v)
        out = recompute(graph, again) if again else graph
        moved = [v for v in saved_activations(out, min_bytes=0) if v in away]
        out = offloaded(out, moved) if moved else out
        peaks = (
            rank_memory(graph, cluster=ctx.options.cluster).peak,
            rank_memory(out, cluster=ctx.options.cluster).peak,
        )
        what = (sorted(v.name for v in again), sorted(v.name for v in moved))
        self._report(ctx, graph, out, f"per value ({_name(ask)})", 0, peaks, what)
        return out


def _decide(ctx: PassContext, graph: Graph, policy: str, budget: int) -> tuple[list[str], list[str], Graph, list[str]]:
    """What ``policy`` recomputes (blocks, or what a budget needs) and offloads (values), the graph
    that does it, and (under a budget) the routed-experts ops it computes in smaller pieces."""
    if policy == "keep":
        return [], [], graph, []
    if policy == "offload":
        moved = saved_activations(graph)
        return [], [v.name for v in moved], offloaded(graph, moved), []
    if policy == "auto":
        d = decide(graph, budget, ctx.options.cluster)
        return d.recomputed, list(d.offloaded), d.graph, d.pieces
    parts = policy_values(graph, policy)
    values = set().union(*parts.values())
    return list(parts), [], recompute(graph, values) if values else graph, []


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


def memory_line(stats: Mapping[str, object]) -> str | None:
    """The memory pass's decision from a compile's ``PassContext.stats``: what it recomputes or offloads,
    the time that adds, and the predicted peak per rank before and after; None if it decided nothing."""
    s = stats.get("memory")
    if not isinstance(s, dict):
        return None
    parts = []
    if s["recomputed"]:
        parts.append(f"recomputed {', '.join(s['recomputed'])} (+{1e3 * s['recompute_s']:.3f} ms)")
    if s["offloaded"]:
        copies = f"+{1e3 * s['offload_s']:.3f} ms; {1e3 * s['copies_s']:.3f} ms of copies"
        parts.append(f"{len(s['offloaded'])} values offloaded ({copies})")
    if s["pieces"]:
        parts.append(f"routed experts in smaller pieces: {', '.join(s['pieces'])}")
    what = "; ".join(parts) or "nothing recomputed or offloaded"
    budget = f" under a budget of {size_text(s['budget'])}" if s["budget"] else ""
    before, after = size_text(s["peak_before"]), size_text(s["peak_after"])
    return f"memory: policy {s['policy']}{budget}; {what}; predicted peak per rank {before} -> {after}"


def _name(fn: Callable[[Saved], str]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
