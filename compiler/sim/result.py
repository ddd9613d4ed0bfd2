"""What a simulation returns: step figures, a memory breakdown and timelines for one device."""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.sim.parallel import ParallelConfig

STREAMS = ("compute", "comm")


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One interval on a stream of the simulated device; ``category`` groups events (fwd, bwd,
    recompute, tp, cp, ep, dp, pp, optimizer, bubble)."""

    stream: str
    name: str
    start: float
    dur: float
    category: str = ""

    def shifted(self, dt: float, prefix: str = "") -> TimelineEvent:
        """This event moved by ``dt`` seconds, its name prefixed."""
        return TimelineEvent(self.stream, prefix + self.name, self.start + dt, self.dur, self.category)


@dataclass(frozen=True, slots=True)
class MemoryPoint:
    """Bytes allocated on the simulated device from time ``t`` on, after ``label`` happened."""

    t: float
    nbytes: float
    label: str


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Peak bytes per device by kind. ``optimizer`` includes fp32 master weights; ``other`` is the
    runtime reserve (CUDA/CANN context, library workspaces, collective buffers of the library)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    comm_buffers: float
    other: float

    @property
    def static(self) -> float:
        """Bytes held for the whole step (everything but activations)."""
        return self.params + self.grads + self.optimizer + self.comm_buffers + self.other

    @property
    def total(self) -> float:
        """Peak bytes on the device."""
        return self.static + self.activations


@dataclass(frozen=True, slots=True)
class SimResult:
    """Simulated optimizer step of ``config``. Times in seconds, memory in bytes per device.

    ``mfu`` = model FLOPs per step / (step time x devices x dense peak of the training dtype);
    ``tflops_per_device`` = model FLOPs / step time / devices / 1e12. ``breakdown`` lists where the
    step time goes (sums to ``step_time_s``). ``a2a_bytes`` is what one device sends to other ranks
    in expert all-to-alls over the step (dispatch and combine, forward, recomputation and backward,
    at the busiest expert rank's load); ``a2a_exposed_s`` the step time spent waiting on them (part
    of ``exposed_comm_s``). ``stage_layers`` are the layers each pipeline rank holds (all its virtual
    chunks) and ``stage_peak_bytes`` each rank's peak; ``peak_memory_bytes`` is the largest.
    ``events`` and ``memory_timeline`` describe pipeline stage 0 (rank 0) and are empty when the
    simulation ran without a timeline."""

    config: ParallelConfig
    step_time_s: float
    mfu: float
    tflops_per_device: float
    tokens_per_s: float
    peak_memory_bytes: float
    memory: MemoryBreakdown
    fits: bool
    exposed_comm_s: float
    bubble_s: float
    compute_s: float
    optimizer_s: float
    num_microbatches: int
    breakdown: tuple[tuple[str, float], ...]
    a2a_bytes: float = 0.0
    a2a_exposed_s: float = 0.0
    stage_layers: tuple[int, ...] = ()
    stage_peak_bytes: tuple[float, ...] = ()
    events: tuple[TimelineEvent, ...] = ()
    memory_timeline: tuple[MemoryPoint, ...] = ()

    def stages_text(self) -> str:
        """The pipeline in words, e.g. ``1F1B, stages: 7, 8x14, 7 layers`` ("" without a pipeline)."""
        if len(self.stage_layers) < 2:
            return ""
        return f"{self.config.schedule_name}, stages: {layer_counts(self.stage_layers)} layers"

    def summary(self) -> str:
        """One deterministic line: config, step time, MFU, memory (and the pipeline's stages)."""
        stages = self.stages_text()
        return (
            f"{self.config.describe()}: step {self.step_time_s * 1e3:.1f} ms, MFU {self.mfu * 100:.1f}%, "
            f"{self.tflops_per_device:.1f} TFLOP/s/device, peak {self.peak_memory_bytes / 2**30:.1f} GiB"
            + (f"; {stages}" if stages else "")
        )


def layer_counts(counts: tuple[int, ...]) -> str:
    """``7, 8x14, 7``: layer counts in stage order, a run of three or more equal ones as ``NxK``."""
    out: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        run = j - i
        out += [f"{counts[i]}x{run}"] if run >= 3 else [str(counts[i])] * run
        i = j
    return ", ".join(out)
