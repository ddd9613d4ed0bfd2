"""The predicted timeline of one rank's scheduled program: a compute, a communication and a copy stream.

Every op costs what the sharding solve prices it at (``passes.cost.axis``: the roofline of the
op's FLOPs and bytes on one device, divided as its layouts divide it; a collective by the cluster's
collective model over its mesh axis; a copy to or from the host tier at the device's ``host_bw``).
Replaying the graph in order: a compute op runs when the compute stream is free; a collective
starts when it is issued and the communication stream is free (collectives run one after another);
``mem.offload`` and ``mem.reload`` run on the copy stream (the copy engine), one after another; a
``comm.wait`` holds the compute stream until its collective or reload has finished, and that hold
is *exposed* communication. A collective or reload without a wait (synchronous) is issued and
waited on at once; an offload is never waited on (the device frees the value once the copy is
done). A CPU rank has no copy engine: its core makes the copies, so there they are compute.
The overlap pass schedules by this model; the Chrome trace of it (``to_chrome_trace``) opens in
Perfetto beside a measured profiler trace.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from meshfold.ir import Graph, Layout, Mesh, Op, OpDef, TensorType, Type, Value
from meshfold.ir.asynchrony import ASYNC_COLLECTIVES, shard_bytes, starts
from meshfold.ir.ops import (
    ALL_GATHER,
    ALL_GATHER_BUCKET,
    ALL_REDUCE,
    ALL_REDUCE_BUCKET,
    ALL_TO_ALL,
    OFFLOAD,
    PPERMUTE,
    RELOAD,
    WAIT,
)
from meshfold.ir.symbolic import Dim, size_hint
from meshfold.passes.cost.axis import AxisModel, axis_models
from meshfold.passes.sharding.opwork import op_bytes, op_flops
from meshfold.target.hardware import LOCAL, Cluster

_KIND = {
    ALL_GATHER: "all_gather",
    ALL_GATHER_BUCKET: "all_gather",
    ALL_REDUCE: "all_reduce",
    ALL_REDUCE_BUCKET: "all_reduce",
    ALL_TO_ALL: "all_to_all",
    PPERMUTE: "p2p",
}


@dataclass(frozen=True)
class Costs:
    """Seconds of each op of a graph on one rank, by the mesh axes' time models."""

    graph: Graph
    models: Sequence[AxisModel]
    _seconds: dict[Op, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Each op's priced kernel time (ops hash by identity; a scheduler asks many times)."""
    _wire: dict[Op, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Each collective's priced wire time (the scheduler and each replay ask again)."""
    _priced: dict[tuple[Hashable, float], float] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Kernel time by ``Op.key`` and how many ways the layouts divide the work (the ops of every layer
    of a stack are priced once)."""
    _ways: dict[Value, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    """How many ways each value's layout divides it (most values are read by several ops)."""
    _ways_by: dict[tuple[Type, Layout], float] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The same by type and layout."""
    _bytes: dict[Value, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    """``nbytes`` of each value asked."""
    _shard_nbytes: Callable[[Value], int] = field(init=False, repr=False, compare=False)
    """``local_nbytes`` on the graph's mesh, kept by type and layout (``asynchrony.shard_bytes``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_shard_nbytes", shard_bytes(self.graph.mesh))

    def compute(self, op: Op) -> float:
        """An op's kernel time on one rank: its work divided as much as its layouts divide it (a
        host-tier copy where the core makes it, ``copy``). Kept per op: a schedule asks many times."""
        t = self._seconds.get(op)
        if t is None:
            t = self._seconds[op] = self._compute(op)
        return t

    def _compute(self, op: Op) -> float:
        if op.target in (OFFLOAD, RELOAD):
            return 0.0 if self.copy_engine else self.copy(op)
        if isinstance(op.target, OpDef):
            return 0.0
        ways = 1.0
        for values in (op.operands, op.results):
            for v in values:
                w = self._ways.get(v)
                if w is None:
                    w = self._ways[v] = self._divided(v)
                if w > ways:
                    ways = w
        key = (op.key(), ways)
        t = self._priced.get(key)
        if t is None:
            t = self._priced[key] = self.models[0].compute(op_flops(op) / ways, op_bytes(op) / ways)
        return t

    def _divided(self, v: Value) -> float:
        """How many ways ``v``'s layout divides it, kept by type and layout (every layer's values are
        of the same few)."""
        shard = (v.type, v.layout)
        w = self._ways_by.get(shard)
        if w is None:
            w = self._ways_by[shard] = _ways(v, self.graph.mesh)
        return w

    def nbytes(self, v: Value) -> int:
        """``local_nbytes`` of ``v`` on this graph's mesh, kept (a collective's operands are asked
        again by each replay and by the scheduler)."""
        n = self._bytes.get(v)
        if n is None:
            n = self._bytes[v] = self._shard_nbytes(v)
        return n

    def started(self, op: Op, start: Op) -> None:
        """Price ``start``, the start of collective ``op`` (its results made handles of the same types
        and layouts), as ``op``: a replay of the scheduled program asks again."""
        self._wire[start] = self.comm(op)
        self._seconds[start] = self.compute(op)
        for h, r in zip(start.results, op.results, strict=True):
            self._bytes[h] = self.nbytes(r)

    @property
    def copy_engine(self) -> bool:
        """Whether the device copies to and from the host tier beside its kernels (a GPU's or NPU's
        copy engine); a CPU rank's core makes the copies itself."""
        return self.models[0].cluster.device.name != LOCAL

    def copy(self, op: Op) -> float:
        """Seconds of a ``mem.offload`` / ``mem.reload`` copy at the device's host bandwidth."""
        moved = op.operands if op.target == OFFLOAD else op.results
        return sum(self.nbytes(v) for v in moved) / self.models[0].cluster.device.host_bw

    def stream(self, op: Op) -> str:
        """Where an op that ``moves_data`` runs beside the compute stream: ``copy`` or ``comm``."""
        return "copy" if op.target in (OFFLOAD, RELOAD) else "comm"

    def comm(self, op: Op) -> float:
        """A collective's wire time over its mesh axis, or a reload's copy time on a device with a copy
        engine (0 on a one-rank axis, for local ops, and for copies a CPU rank's core makes). Kept
        per op: every op is asked, by each replay and by the scheduler."""
        t = self._wire.get(op)
        if t is None:
            t = self._wire[op] = self._comm(op)
        return t

    def _comm(self, op: Op) -> float:
        if not isinstance(op.target, OpDef):
            return 0.0
        if op.target == RELOAD:
            return self.copy(op) if self.copy_engine else 0.0
        if op.target not in ASYNC_COLLECTIVES or self.graph.mesh is None:
            return 0.0
        model = self.models[self.graph.mesh.index(str(op.kwarg("axis")))]
        kind = _KIND.get(op.target, "reduce_scatter")  # type: ignore[call-overload]
        # NOTE: the collective model takes the whole buffer: a gather's result, a reduction's input
        held = op.results if kind == "all_gather" else op.operands
        size = sum(self.nbytes(v) for v in held)
        return 0.0 if model.size <= 1 else model.collective(kind, size)

    def moves_data(self, op: Op) -> bool:
        return self.comm(op) > 0.0


def _ways(v: Value, mesh: Mesh | None) -> float:
    t = v.type
    if mesh is None or not isinstance(t, TensorType):
        return 1.0
    return _divides(t.shape, v.layout, mesh)


@lru_cache(maxsize=16384)
def _divides(shape: tuple[Dim, ...], layout: Layout, mesh: Mesh) -> float:
    """How many ways ``layout`` divides a value of ``shape`` (every layer's values ask the same)."""
    whole = math.prod(size_hint(d) for d in shape)
    local = math.prod(size_hint(d) for d in layout.local_shape(shape, mesh))
    return whole / local if local else 1.0


@dataclass(frozen=True, slots=True)
class Event:
    """One box on a stream: ``stream`` is ``compute``, ``comm``, ``copy`` or ``wait`` (the compute stream held)."""

    stream: str
    name: str
    phase: str
    start: float
    seconds: float


@dataclass
class Timeline:
    """A replayed program: its events and, per phase, the busy, communication and exposed seconds."""

    events: list[Event] = field(default_factory=list)
    end: dict[str, float] = field(default_factory=dict)
    comm: dict[str, float] = field(default_factory=dict)
    exposed: dict[str, float] = field(default_factory=dict)

    @property
    def step(self) -> float:
        return sum(self.end.values())

    @property
    def exposed_total(self) -> float:
        return sum(self.exposed.values())

    @property
    def comm_total(self) -> float:
        return sum(self.comm.values())


def replay(graph: Graph, costs: Costs, events: bool = True) -> Timeline:
    """The timeline of ``graph`` run in its op order, forward then backward (see the module doc);
    ``events=False``: its totals alone (``Timeline.events`` left empty, as a pass's statistics need)."""
    tl = Timeline()
    waits = starts(graph)
    started = set(waits.values())
    phases: dict[str, list[Op]] = {"fwd": [], "bwd": []}
    for op in graph.ops:
        phases[op.prov.phase].append(op)
    for phase, ops in phases.items():
        now = exposed = busy = 0.0
        free = {"comm": 0.0, "copy": 0.0}
        done: dict[Op, float] = {}
        for op in ops:
            wire = costs.comm(op)
            if op.target == WAIT:
                start = waits[op]
                now, exposed = _hold(tl if events else None, phase, op, done.pop(start), now, exposed)
                continue
            if op.target == OFFLOAD and costs.copy_engine:  # NOTE: on the copy engine, never waited on
                begin = max(now, free["copy"])
                free["copy"] = begin + costs.copy(op)
                if events:
                    tl.events.append(Event("copy", op.name, phase, begin, free["copy"] - begin))
                continue
            if wire > 0.0:
                stream = costs.stream(op)
                begin = max(now, free[stream])
                free[stream] = end = begin + wire
                busy += wire if stream == "comm" else 0.0
                if events:
                    tl.events.append(Event(stream, op.name, phase, begin, wire))
                done[op] = end
                if op not in started:
                    now, exposed = _hold(tl if events else None, phase, op, end, now, exposed)
                continue
            t = costs.compute(op)
            if t > 0.0 and events:
                tl.events.append(Event("compute", op.name, phase, now, t))
            now += t
        for end in done.values():  # NOTE: a collective never waited on still ends the phase
            now = max(now, end)
        tl.end[phase], tl.comm[phase], tl.exposed[phase] = now, busy, exposed
    return tl


def _hold(tl: Timeline | None, phase: str, op: Op, until: float, now: float, exposed: float) -> tuple[float, float]:
    if until > now:
        if tl is not None:
            tl.events.append(Event("wait", f"wait {op.name}", phase, now, until - now))
        return until, exposed + until - now
    return now, exposed


def to_chrome_trace(tl: Timeline, label: str = "rank 0 (predicted)") -> dict[str, Any]:
    """Chrome trace-event JSON (opens in Perfetto): one thread per stream, the backward after the
    forward, times in microseconds."""
    streams = ("compute", "comm", "copy", "wait")
    out: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": label}}]
    for tid, s in enumerate(streams):
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": s}})
    offset = {"fwd": 0.0, "bwd": tl.end.get("fwd", 0.0)}
    for e in tl.events:
        out.append(
            {
                "name": e.name,
                "cat": e.phase,
                "ph": "X",
                "pid": 0,
                "tid": streams.index(e.stream),
                "ts": 1e6 * (offset[e.phase] + e.start),
                "dur": 1e6 * e.seconds,
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def predicted(graph: Graph, cluster: Cluster | None = None) -> Timeline:
    """The replayed timeline of a compiled graph on ``cluster`` (None: gloo ranks on this CPU)."""
    if graph.mesh is None:
        raise ValueError("a predicted timeline needs a graph with a mesh (after sharding)")
    return replay(graph, Costs(graph, axis_models(graph.mesh, cluster)))


def write_trace(trace: dict[str, Any], path: str | Path) -> Path:
    """Write a Chrome trace to ``path`` whole or not at all (a temporary file renamed into place)."""
    out = Path(path)
    fd, tmp = tempfile.mkstemp(dir=out.parent if str(out.parent) else ".", prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(trace, f)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
