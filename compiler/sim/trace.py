"""Exports of a simulated step: Chrome trace JSON (opens in Perfetto / chrome://tracing) and a
memory plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshfold.sim.result import STREAMS, SimResult


def to_chrome_trace(result: SimResult) -> dict[str, Any]:
    """Chrome trace-event JSON of ``result``'s timeline: one process (the simulated device), one
    thread per stream, complete ("X") events in microseconds, and a memory counter track.
    Raises ValueError when the simulation ran without a timeline."""
    if not result.events:
        raise ValueError("result has no timeline; run simulate(..., timeline=True)")
    trace: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": 0,
            "tid": 0,
            "args": {"name": f"rank 0 ({result.config.describe()})"},
        },
    ]
    for tid, stream in enumerate(STREAMS):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": stream}})
    for e in result.events:
        trace.append(
            {
                "name": e.name,
                "cat": e.category or e.stream,
                "ph": "X",
                "ts": e.start * 1e6,
                "dur": e.dur * 1e6,
                "pid": 0,
                "tid": STREAMS.index(e.stream),
            }
        )
    for p in result.memory_timeline:
        trace.append(
            {"name": "memory", "ph": "C", "pid": 0, "tid": 0, "ts": p.t * 1e6, "args": {"GiB": p.nbytes / 2**30}}
        )
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {"step_time_s": result.step_time_s, "mfu": result.mfu},
    }


def plot_memory(result: SimResult, path: str | Path) -> Path:
    """Write a PNG of the simulated device's memory over one step to ``path`` and return it.
    Needs matplotlib (imported here only); raises RuntimeError telling how to install it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError(
            "plot_memory needs matplotlib: pip install matplotlib (or the meshfold `dev` extra)"
        ) from exc
    if not result.memory_timeline:
        raise ValueError("result has no memory timeline; run simulate(..., timeline=True)")
    xs = [p.t * 1e3 for p in result.memory_timeline]
    ys = [p.nbytes / 2**30 for p in result.memory_timeline]
    fig = Figure(figsize=(9, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.step(xs, ys, where="post", label="allocated")
    ax.axhline(result.memory.static / 2**30, color="grey", linestyle=":", label="static (params, grads, optimizer)")
    ax.set_xlabel("time in step (ms)")
    ax.set_ylabel("GiB")
    ax.set_title(f"memory of rank 0: {result.config.describe()}")
    ax.legend(loc="upper right")
    out = Path(path)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    return out
