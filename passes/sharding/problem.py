"""What the sharding solve is given (``Problem``) and what it answers (``Solution``, ``AxisStats``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from meshfold.ir import Graph, Layout, Mesh, Op, Value
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
    time_limit: float = 30.0
    """Seconds HiGHS may spend per axis; past it the best solution found so far is used. The
    result may then depend on machine speed: compile on one rank and share the graph."""
    status: Callable[[str], AbstractContextManager[object]] = quiet
    """Shown while each axis is solved (see ``PassContext.status``)."""
    share_blocks: bool = True
    """Ops and parameters of repeated blocks (``layers.1`` ... mirroring ``layers.0``) share one set
    of strategy and layout variables: every layer of a stack gets the same plan, and the integer
    program has one layer's binaries instead of all of them."""
    batch_axes: frozenset[str] = frozenset()
    """Mesh axes that keep the batch split (a preset's ``ddp`` / ``fsdp`` axes): on them a value
    computed from the user's inputs is never moved off a Shard for an op to read (only a graph
    output may gather it), so every rank computes its own part of the batch (see ``batch.py``)."""


@dataclass(frozen=True)
class AxisStats:
    """What one axis's integer program was: its binaries, how many ops shared another op's, and the
    optimum it reached (seconds of modelled step time)."""

    axis: str
    binaries: int
    shared_ops: int
    objective: float


@dataclass(frozen=True)
class Solution:
    """One strategy per op and mesh axis, and the layout chosen for every free input."""

    strategies: list[list[Strategy]]
    inputs: dict[Value, Layout]
    stats: tuple[AxisStats, ...] = ()
