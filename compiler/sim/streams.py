"""Two-stream layout of one pass over a layer: compute ops in order, collectives that block the
compute stream, run beside one compute op, or are pipelined with a GEMM in chunks.

Whatever runs beside compute slows it by the device's ``contention`` (communication kernels
occupy SMs and HBM bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.sim.result import TimelineEvent


@dataclass(frozen=True, slots=True)
class LayerCost:
    """Seconds for one micro-batch: ``bwd_s`` includes recomputation; ``*_exposed_s`` is the part
    of the stream time the compute stream spent waiting on collectives; ``comm_s`` all collective
    time; events are relative to the start of the pass. ``a2a_exposed_s`` is the part of the
    exposed time spent waiting on expert all-to-alls, ``a2a_bytes`` what this device sends to other
    ranks in them (forward, recomputation and backward). ``wgrad_s`` is the part of ``bwd_s`` spent
    on weight-gradient GEMMs (what a zero-bubble schedule defers into the pipeline bubble)."""

    fwd_s: float
    bwd_s: float
    fwd_exposed_s: float
    bwd_exposed_s: float
    comm_s: float
    recompute_s: float
    fwd_events: tuple[TimelineEvent, ...]
    bwd_events: tuple[TimelineEvent, ...]
    a2a_exposed_s: float = 0.0
    a2a_bytes: float = 0.0
    wgrad_s: float = 0.0


def weight_grad_s(events: list[TimelineEvent]) -> float:
    """Seconds of weight-gradient GEMMs among backward ``events``: the ones named ``... wgrad`` and
    half of each grouped expert GEMM's backward (it runs the data and the weight gradient)."""
    total = 0.0
    for e in events:
        if e.stream != "compute":
            continue
        if e.name.endswith(" wgrad"):
            total += e.dur
        elif e.name.startswith("experts fc") and e.name.endswith(" bwd"):
            total += e.dur / 2
    return total


class Streams:
    """Two-stream layout of one pass: compute ops in order, collectives that block or overlap."""

    def __init__(self, contention: float, category: str) -> None:
        self.now = 0.0
        self.comm_free = 0.0
        self.exposed = 0.0
        self.exposed_by: dict[str, float] = {}
        self.comm_busy = 0.0
        self.contention = contention
        self.category = category
        self.events: list[TimelineEvent] = []

    def _expose(self, dt: float, category: str) -> None:
        self.exposed += dt
        self.exposed_by[category] = self.exposed_by.get(category, 0.0) + dt

    def _comm(self, name: str, start: float, dur: float, category: str) -> float:
        self.events.append(TimelineEvent("comm", name, start, dur, category))
        self.comm_free = start + dur
        self.comm_busy += dur
        return self.comm_free

    def compute(self, name: str, dur: float) -> None:
        """Append a compute op of ``dur`` seconds to the compute stream."""
        if dur > 0:
            self.events.append(TimelineEvent("compute", name, self.now, dur, self.category))
            self.now += dur

    def blocking(self, name: str, dur: float, category: str) -> None:
        """A collective whose result the next compute op needs."""
        if dur > 0:
            end = self._comm(name, max(self.now, self.comm_free), dur, category)
            self._expose(end - self.now, category)
            self.now = end

    def beside(self, comm_name: str, comm_dur: float, name: str, dur: float, category: str) -> None:
        """A collective launched now that runs beside compute op ``name``; both must finish."""
        if comm_dur <= 0:
            self.compute(name, dur)
            return
        end = self._comm(comm_name, max(self.now, self.comm_free), comm_dur, category)
        self.compute(name, dur + self.contention * min(dur, comm_dur))
        if end > self.now:
            self._expose(end - self.now, category)
            self.now = end

    def pipelined(
        self, comm_name: str, comm_dur: float, name: str, gemm_dur: float, chunks: int, comm_first: bool, category: str
    ) -> None:
        """A GEMM split in ``chunks`` with its collective (all-gather before / reduce-scatter after)."""
        if comm_dur <= 0:
            self.compute(name, gemm_dur)
            return
        g = gemm_dur * (1 + self.contention)
        total = max(g, comm_dur) + min(g, comm_dur) / chunks
        start = max(self.now, self.comm_free)
        self._expose(total - g + (start - self.now), category)
        c_start, g_start = (start, start + total - g) if comm_first else (start + total - comm_dur, start)
        self._comm(comm_name, c_start, comm_dur, category)
        self.events.append(TimelineEvent("compute", name, g_start, g, self.category))
        self.now = start + total
