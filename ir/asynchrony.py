"""Asynchronous ops: a collective or a reload issued at one point of a rank's program and waited on later.

A collective (or a ``mem.reload`` from the host tier) whose results a ``comm.wait`` reads is
*started*: it yields handles, not values. The ``comm.wait`` takes all of them (in order) and
returns the values, and every use reads the wait's results. The op order of the graph is the
schedule: what sits between a start and its wait runs while the collective is on the wire (the
reload on the copy engine). Rules (checked by :func:`check_waits`):

* a ``comm.wait`` reads every result of one op that can run asynchronously (``ASYNC_OPS``), in
  order, and returns values of the same types and layouts;
* a started op's handles are read by that wait and nothing else (no op, no graph output),
  and both are in the same phase (the forward and the backward are separate programs);
* SSA then puts every wait after its start and every use after its wait.

:func:`inflight` walks the order and gives the most bytes a rank holds in started, not yet waited
ops' results (a started reload's device copy included); :func:`check_inflight` compares that to a bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshfold.ir.graph import Graph, Op, Value, local_nbytes
from meshfold.ir.mesh import Mesh
from meshfold.ir.ops import (
    ALL_GATHER,
    ALL_GATHER_BUCKET,
    ALL_REDUCE,
    ALL_REDUCE_BUCKET,
    ALL_TO_ALL,
    PPERMUTE,
    REDUCE_SCATTER,
    REDUCE_SCATTER_BUCKET,
    RELOAD,
    WAIT,
)
from meshfold.ir.placement import Layout
from meshfold.ir.types import Type

ASYNC_COLLECTIVES = frozenset(
    {ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ALL_TO_ALL, ALL_GATHER_BUCKET, ALL_REDUCE_BUCKET, REDUCE_SCATTER_BUCKET}
    | {PPERMUTE}
)
"""The collectives that move data between ranks (``comm.shard``/``comm.partial`` are local)."""
ASYNC_OPS = ASYNC_COLLECTIVES | {RELOAD}
"""What a ``comm.wait`` may wait for: those collectives, and a reload from the host tier."""


class ScheduleError(ValueError):
    """The graph's starts and waits break a rule; the message names the ops and what to change."""


def starts(graph: Graph) -> dict[Op, Op]:
    """Each ``comm.wait`` → the collective it waits for (checked: :func:`check_waits`)."""
    waits = [op for op in graph.ops if op.target == WAIT and op.operands]
    if not waits:  # NOTE: a program not yet scheduled: no map of every value's producer
        return {}
    # NOTE: only the ops that make a waited handle, not every value's producer (a replay and the
    # in-flight walk ask of a program of tens of thousands of ops)
    handles = {op.operands[0] for op in waits}
    producers = {r: op for op in graph.ops for r in op.results if r in handles}
    return {op: producers[op.operands[0]] for op in waits}


def check_waits(graph: Graph) -> None:
    """Raise :class:`ScheduleError` unless every start and wait follows the module's rules."""
    producers = graph.producers()
    waited: dict[Op, Op] = {}
    for op in graph.ops:
        if op.target != WAIT:
            continue
        if not op.operands or op.operands[0] not in producers:
            raise ScheduleError(f"{op.describe()}: comm.wait must read the results of a collective or a reload")
        start = producers[op.operands[0]]
        if start.target not in ASYNC_OPS:
            raise ScheduleError(
                f"{op.describe()}: it waits on {start.describe()}, "
                "which is neither an asynchronous collective nor a reload"
            )
        if op.operands != start.results:
            raise ScheduleError(f"{op.describe()}: it must read every result of {start.describe()}, in order")
        if start in waited:
            raise ScheduleError(
                f"{start.describe()}: it is waited on twice ({waited[start].describe()}, {op.describe()})"
            )
        if start.prov.phase != op.prov.phase:
            raise ScheduleError(
                f"{op.describe()}: it waits in the {op.prov.phase} on {start.describe()}, started in the "
                f"{start.prov.phase}; a start and its wait belong to one phase"
            )
        for h, r in zip(op.operands, op.results, strict=True):
            if (h.type, h.layout) != (r.type, r.layout):
                raise ScheduleError(f"{op.describe()}: result %{r.name} must have the type and layout of %{h.name}")
        waited[start] = op
    handles = {h: w for s, w in waited.items() for h in s.results}
    for op in graph.ops:
        if op.target == WAIT:
            continue
        for v in op.operands:
            if v in handles:
                raise ScheduleError(
                    f"{op.describe()}: it reads %{v.name}, a handle of a started collective; read the result of "
                    f"{handles[v].describe()} instead"
                )
    for o in graph.outputs:
        if o.value in handles:
            raise ScheduleError(f"output {o.kind}({o.name}) is a started collective's handle; output its wait's result")


@dataclass(frozen=True)
class Inflight:
    """The most bytes one rank held in started, not yet waited collectives, and the op at that point;
    ``over``: the first start that took a rank above ``bound`` with another collective in flight."""

    peak: float
    at: Op | None
    over: Op | None = None
    over_bytes: float = 0.0


def inflight(graph: Graph, bound: float = float("inf"), *, nbytes: Callable[[Value], int] | None = None) -> Inflight:
    """Walk the order: a start adds its results' bytes on one rank (``nbytes``, by default
    ``local_nbytes`` on the graph's mesh), its wait takes them away."""
    waits = starts(graph)
    started = set(waits.values())
    size = nbytes if nbytes is not None else shard_bytes(graph.mesh)
    now, peak, at, over, over_bytes = 0.0, 0.0, None, None, 0.0
    held: dict[Op, float] = {}
    for op in graph.ops:
        if op in started:
            held[op] = sum(size(r) for r in op.results)
            now += held[op]
            if now > peak:
                peak, at = now, op
            if over is None and now > bound and len(held) > 1:
                over, over_bytes = op, now
        elif op in waits:
            now -= held.pop(waits[op], 0.0)
    return Inflight(peak, at, over, over_bytes)


def shard_bytes(mesh: Mesh | None) -> Callable[[Value], int]:
    """``local_nbytes`` on ``mesh``, kept by type and layout (the collectives of every layer hold the
    same few shards)."""
    known: dict[tuple[Type, Layout], int] = {}

    def size(v: Value) -> int:
        shard = (v.type, v.layout)
        n = known.get(shard)
        if n is None:
            n = known[shard] = local_nbytes(v, mesh)
        return n

    return size


def check_inflight(graph: Graph, bound: float) -> None:
    """Raise :class:`ScheduleError` when a rank ever holds more than ``bound`` bytes in flight in more
    than one collective (one collective larger than the bound runs alone)."""
    got = inflight(graph, bound)
    if got.over is not None:
        raise ScheduleError(
            f"{got.over.describe()}: {got.over_bytes / 2**20:.2f} MiB are in flight on a rank once it starts, over "
            f"the bound of {bound / 2**20:.2f} MiB; wait earlier or raise overlap{{max-inflight=...}}"
        )
