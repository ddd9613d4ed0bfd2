"""What the sharding solve is given (``Problem``) and what it answers (``Solution``, ``AxisStats``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from meshfold.ir import Graph, Layout, Mesh, Op, Placement, Value
from meshfold.passes.base import quiet
from meshfold.passes.cost.axis import AxisModel
from meshfold.passes.sharding.strategy import Strategy


@dataclass(frozen=True)
class Problem:
    """What the solver needs. ``start``: the layout fixed graph inputs are used in; ``free``: graph
    inputs whose layout the solver chooses (``plan="auto"``); ``wants[k]``: the layout graph output
    ``k`` must end in, or the free parameter whose layout its gradient must match; ``models``:
    the time model of each mesh axis (``passes.cost.axis``); ``memory``: per-device bytes for
    parameters with their gradient and Adam state plus saved activations (None: unbounded);
    ``valid(op, s, earlier)``: whether strategy ``s`` fits the op's shapes given the earlier axes'
    choices."""

    graph: Graph
    mesh: Mesh
    candidates: Sequence[list[Strategy]]
    start: dict[Value, Layout]
    free: frozenset[Value]
    wants: dict[int, Layout | Value]
    models: tuple[AxisModel, ...]
    valid: Callable[[Op, Strategy, list[Strategy]], bool]
    memory: float | None = None
    spill: tuple[tuple[float, float], ...] = ()
    """What the memory pass charges to free saved activations under ``memory``
    (``passes.memory.budget.spill_prices``: seconds per byte, share of the saved bytes, cheapest
    first); empty: the bound holds for the layouts alone."""
    travels: Mapping[Value, float] = field(default_factory=dict)
    """Bytes per byte of its type a value moves in, where they differ: under a precision policy a
    gradient is reduced in the reduce dtype while the graph computes it in the parameter dtype."""
    states: Mapping[Value, float] = field(default_factory=dict)
    """Bytes per byte of its type a parameter's state (itself, its gradient, two Adam moments) holds,
    where they differ: under a precision policy it is fp32 while the graph computes it in bf16."""
    gap: float = 1e-3
    """Relative gap at which a plan counts as optimal: its modelled time is within this fraction of
    the proven lower bound."""
    node_limit: int = 20000
    """Branch-and-bound nodes HiGHS may explore per axis before it settles for the best plan
    found (a unit of work, not of time: the same model and mesh always give the same plan)."""
    status: Callable[[str], AbstractContextManager[object]] = quiet
    """Shown while each axis is solved (see ``PassContext.status``)."""
    share_blocks: bool = True
    """Ops and parameters of repeated blocks (``layers.1`` ... mirroring ``layers.0``) share one set
    of strategy and layout variables: every layer of a stack gets the same plan, and the integer
    program has one layer's binaries instead of all of them."""
    keys: Sequence[int] = ()
    """Per op, in program order, an integer equal for ops with the same ``blocks.op_kinds`` and the
    same pinned operands (a mirrored layer's op: the same work and the same strategies fit it);
    empty: each op its own."""
    batch_axes: frozenset[str] = frozenset()
    """Mesh axes that keep the batch split (a preset's ``ddp`` / ``fsdp`` axes): on them a value
    computed from the user's inputs is never moved off a Shard for an op to read (only a graph
    output may gather it), so every rank computes its own part of the batch (see ``batch.py``)."""
    sequence_axes: frozenset[str] = frozenset()
    """Batch axes that split each input's sequence (a preset's ``cp`` axes). There every attention
    reads its queries, keys, values (and output gradient) split: by sequence, batch or heads (an
    all-to-all from the sequence split: Ulysses), never whole; and the token ids and labels
    (integers) may be read whole by an op that cannot read them split (the labels' shift by one)."""
    mirrored: tuple[dict[str, str], dict[int, int]] | None = None
    """``passes.blocks.mirrors`` of the graph where the caller has it (the same for every problem
    made of one graph: a preset's, ``auto``'s); None: found when the solve needs it."""
    cp_method: str = "auto"
    """How attention reads the sequence split on those axes (``passes.cp.CpSpec.method``): by heads
    or batch (``ulysses``), by sequence as ring attention (``ring``), or as priced (``auto``)."""


@dataclass(frozen=True)
class AxisStart:
    """A known plan for one axis (a preset's): each op's strategy and each free input's placement."""

    strategies: list[Strategy]
    inputs: dict[Value, Placement]


@dataclass(frozen=True)
class AxisStats:
    """What one axis's integer program was and what HiGHS made of it: its binaries, how many ops
    shared another op's columns, its columns and rows, how many value moves folded into a mirrored
    block's (``folded``), the objective reached (seconds of modelled step time on this axis), the
    relative ``gap`` to the proven bound, whether that is within the asked gap (``optimal``) or
    the node limit stopped the search, and the nodes explored."""

    axis: str
    binaries: int
    shared_ops: int
    objective: float
    compute: float = 0.0
    """The part of ``objective`` that is the ops' own compute."""
    columns: int = 0
    rows: int = 0
    gap: float = 0.0
    optimal: bool = True
    nodes: int = 0
    folded: int = 0
    spill: float = 0.0
    """The part of ``objective`` that the memory pass is expected to add, recomputing or offloading
    what the layouts leave over the memory bound (``Problem.spill``); the rest is this axis's traffic."""

    def describe(self) -> str:
        state = "optimal" if self.optimal else "stopped at the node limit"
        return (
            f"mesh axis {self.axis!r}: {self.binaries} binaries, {self.columns} columns, {self.rows} rows, "
            f"{self.shared_ops} ops sharing a repeated block's columns; {state} after {self.nodes} nodes, "
            f"gap {100 * self.gap:.2f}%, {self.objective * 1e3:.3f} ms"
        )


@dataclass(frozen=True)
class Solution:
    """One strategy per op and mesh axis, and the layout chosen for every free input."""

    strategies: list[list[Strategy]]
    inputs: dict[Value, Layout]
    stats: tuple[AxisStats, ...] = ()

    @property
    def step_time(self) -> float:
        """Modelled seconds per step: the ops' compute and the memory pass's share as the last axis
        prices them (split by every axis) plus every axis's traffic."""
        if not self.stats:
            return 0.0
        *earlier, last = self.stats
        return last.objective + sum(s.objective - s.compute - s.spill for s in earlier)

    @property
    def optimal(self) -> bool:
        return all(s.optimal for s in self.stats)


def step_line(stats: Mapping[str, object]) -> str | None:
    """The solved plan's modelled step time beside the preset's, from a compile's ``PassContext.stats``."""
    step = stats.get("sharding.step_time")
    if not isinstance(step, float):
        return None
    line = f"modelled step time {1e3 * step:.3f} ms"
    axes = stats.get("sharding.solve")
    spill = axes[-1].spill if isinstance(axes, tuple) and axes and isinstance(axes[-1], AxisStats) else 0.0
    if spill:
        line += f" (of which {1e3 * spill:.3f} ms the memory pass's, freeing what the layouts leave over the bound)"
    preset = stats.get("sharding.preset")
    if isinstance(preset, tuple):
        line += f"; the {preset[0]} preset's layouts: {1e3 * preset[1]:.3f} ms"
    return line


def attention_lines(stats: Mapping[str, object]) -> tuple[str, ...]:
    """How attention reads a split sequence, from a compile's ``PassContext.stats``: the sharding
    pass's choice per attention (``passes.cp.describe``), then the ring steps ``ring-steps`` wrote out."""
    lines: list[str] = []
    for key in ("cp.attention", "cp.ring_steps"):
        got = stats.get(key)
        lines += [str(x) for x in got] if isinstance(got, tuple) else []
    return tuple(lines)


def solve_report(stats: Mapping[str, object]) -> tuple[str, ...]:
    """The sharding solve of a compile in lines: each mesh axis's program and how far HiGHS got
    (optimal or stopped at the node limit, and the gap), then ``step_line``; then how attention reads
    a split sequence (``attention_lines``); empty if none of it ran."""
    cp = attention_lines(stats)
    axes = stats.get("sharding.solve")
    if not isinstance(axes, tuple):
        return cp
    step = step_line(stats)
    return (*(a.describe() for a in axes if isinstance(a, AxisStats)), *([step] if step else []), *cp)
