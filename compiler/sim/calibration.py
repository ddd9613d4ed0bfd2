"""The published training runs the simulator is scored on, split into a half that fits the Hopper
constants and a half held out to check them.

Every run the project keeps as a published reference with a reported MFU, model dimensions, parallel sizes,
batch and GPU count: the five rows of the Megatron-Core H100 weak-scaling table, the two ends
of its GPT-3 175B strong-scaling run (96 and 4,608 H100, batch 1,152, MFU 47 % and 42 %), and
the two 8K-context rows of Llama 3 405B's pre-training (8,192 and 16,384 H100, MFU 43 % and 41 %).
torchtitan's Llama 3.1 8B figures are left out: its H100s are 96 GB HBM2e parts at a 500 W cap
whose peak torchtitan says it does not know (torchtitan docs/performance.md), not a catalog part.

Assumptions about the Megatron runs (Megatron-LM README; what it does not say is Megatron-LM's default):
GPT with LayerNorm and biases, 4h GELU MLP, untied embeddings, vocabulary 131,072, sequence 4,096;
bf16 with fp32 gradients, Adam, distributed optimizer, micro-batch 1, sequence parallel with TP,
dp and tp communication overlapped, equal layers per stage. The strong-scaling runs use the
table's 177B model ("slightly more than 175 billion parameters due to larger vocabulary") at its
TP 8, PP 6 (no plan is published for them).

The pipeline schedule is interleaved 1F1B: the README says the runs overlap pipeline-parallel
communication, and Megatron-LM turns that overlap off unless the schedule is interleaved
(``megatron/training/arguments.py``: "Overlap P2P communication is disabled if not using the
interleaved schedule"). How many chunks each stage holds is not published; a run is scored with
the one the simulator finds fastest among those that divide its layers per stage (``vpps``), as
a tuned run would be.

The Llama 3 runs ("The Llama 3 Herd of Models", Meta 2024, sec. 3.3 and Table 4): the 405B model
(``model.PRESETS["llama3-405b"]``: 126 layers, hidden 16,384, FFN 53,248, 128 heads, 8 KV heads,
vocabulary 128,256, SwiGLU, RMSNorm, no biases, untied), sequence 8,192, 16M tokens a step
(batch 32 sequences a data-parallel rank at DP 64, 16 at DP 128: 2,048 sequences), BF16, H100
SXM 80 GB on a 400 Gb/s RoCE fabric (``roce400``), TP 8, PP 16, parallel groups ordered
[TP, CP, PP, DP]. Published beside them: FSDP shards the optimizer state and the gradients but
does not reshard the parameters after the forward (``zero=2``: bf16 parameters whole, fp32
gradients and Adam state sharded); gradients accumulate and are reduce-scattered in FP32; one
Transformer layer fewer on the first and the last stage, the first chunk holding only the
embedding and the last only the output layer and loss (``stage_split="edges"``, which with 126
layers over 16 stages means one layer a chunk: ``vpp`` 8); an interleaved schedule; 8K sequences
without activation checkpointing. Assumed where nothing is published: micro-batch 1 sequence
(Megatron-style interleaving), no TP communication overlap (none is reported), Adam, and MFU
counting the whole attention square as the Megatron runs do (torchtitan's convention too: "we
follow the convention and do not account for sparsity in causal attention").

The paper's third row (16,384 H100 at CP 16, sequence 131,072, 38 % MFU) is ``LONG_CONTEXT``,
kept beside the scored runs and not among them: its attention (all-gathered keys and values,
``cp_method="allgather"``) is over half of the counted FLOPs, so its error rests on the
attention-FLOP convention (whole square or causal half), which the paper does not state.

Split rule: the Megatron runs (the runs the constants were first fitted on) sorted by parameter
count, then GPU count; the 1st, 3rd, 5th, ... fit the constants, the 2nd, 4th, ... are held out.
Runs marked ``held_out`` (published by others, added after the fit) are always held out, so adding
one moves neither the fit half nor the fitted values. ``FITTED`` names the ``Efficiency`` fields
the fit sets; ``fit`` minimises the squared relative MFU error over the fit half only (scipy's
``least_squares``); the values it found live in ``hardware.HOPPER``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshfold.sim.model import PRESETS, ModelSpec, gpt
from meshfold.sim.parallel import ParallelConfig, TrainSpec
from meshfold.sim.result import SimResult
from meshfold.sim.simulate import simulate
from meshfold.target.hardware import Cluster, Efficiency, parse_cluster

GOAL = 0.15
"""Relative MFU error the held-out runs should stay within."""
FITTED = ("gemm_max", "gemm_mn_half")
"""The ``Efficiency`` fields the fit sets: the sustained GEMM ceiling and the output size at which
a GEMM's partly empty last wave halves it (how much small models lose to small GEMMs)."""
BOUNDS = ((0.5, 0.8), (1e5, 2e7))
"""Physical ranges of ``FITTED``: at most the best-shape GEMM rate (0.80 of peak on H100), and
between a fraction of one wave of tiles and a few waves."""
MEGATRON = "Megatron-LM README, Training Speed and Scalability"
LLAMA3 = "The Llama 3 Herd of Models (Meta 2024), Table 4"


@dataclass(frozen=True, slots=True)
class PublishedRun:
    """One published training run: what ran, on how many GPUs, and the MFU it reported."""

    name: str
    source: str
    model: ModelSpec
    gpus: int
    config: ParallelConfig
    train: TrainSpec
    mfu: float
    vpps: tuple[int, ...] = (1,)
    """Chunks per pipeline stage the run may have used (``config`` has the first)."""
    nic: str = ""
    """The NIC between nodes (a ``hardware.LINKS`` name; empty: the H100 default, InfiniBand NDR)."""
    held_out: bool = False
    """Never in the fit half (``halves``): a run added after the constants were fitted."""

    def configs(self) -> tuple[ParallelConfig, ...]:
        """``config`` with each of ``vpps``."""
        return tuple(replace(self.config, vpp=v) for v in self.vpps)

    def simulated(self, eff: Efficiency | None = None) -> SimResult:
        """The simulation of the fastest of ``configs`` (with ``eff`` in place of the catalog's constants)."""
        cluster = self.cluster(eff)
        results = (simulate(self.model, cluster, c, self.train, timeline=False) for c in self.configs())
        return min(results, key=lambda r: r.step_time_s)

    def cluster(self, eff: Efficiency | None = None) -> Cluster:
        """The run's H100 cluster (8 GPUs a node, ``nic`` between them), with ``eff`` in place of the
        catalog constants."""
        c = parse_cluster(f"h100:8x{self.gpus // 8}" + (f"@{self.nic}" if self.nic else ""))
        return c if eff is None else replace(c, device=replace(c.device, eff=eff))


def _megatron(
    name: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, mfu: float, source: str
) -> PublishedRun:
    per_stage = layers // pp
    vpps = tuple(v for v in range(2, per_stage + 1) if per_stage % v == 0) if pp > 1 else (1,)
    cfg = ParallelConfig(
        dp=gpus // (tp * pp),
        tp=tp,
        pp=pp,
        vpp=vpps[0],
        micro_batch_size=1,
        zero=1,
        tp_comm_overlap=True,
        stage_split="even",
    )
    model = gpt(name, layers, hidden, heads)
    return PublishedRun(name, source, model, gpus, cfg, TrainSpec(4096, batch), mfu, vpps)


def _llama3(name: str, gpus: int, cp: int, seq: int, per_dp: int, mfu: float) -> PublishedRun:
    """A Llama 3 405B pre-training row of Table 4 at TP 8, PP 16 (module docstring); ``per_dp`` is
    the table's batch size per data-parallel rank in sequences."""
    tp, pp = 8, 16
    dp = gpus // (tp * cp * pp)
    cfg = ParallelConfig(
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        vpp=8,
        micro_batch_size=1,
        zero=2,
        order="tp-cp-pp-ep-dp",
        cp_method="allgather",
        stage_split="edges",
    )
    source = f"{LLAMA3}, {gpus} GPUs" + (f", CP {cp}, seq {seq}" if cp > 1 else "")
    return PublishedRun(
        name, source, PRESETS["llama3-405b"], gpus, cfg, TrainSpec(seq, dp * per_dp), mfu, (8,), "roce400", True
    )


RUNS: tuple[PublishedRun, ...] = (
    _megatron("1.7B", 16, 2048, 24, 1, 1, 48, 192, 0.41, f"{MEGATRON}, weak scaling"),
    _megatron("16B", 48, 6144, 32, 4, 1, 192, 192, 0.49, f"{MEGATRON}, weak scaling"),
    _megatron("70B", 64, 8192, 84, 8, 2, 768, 384, 0.42, f"{MEGATRON}, weak scaling"),
    _megatron("177B", 96, 12288, 96, 8, 6, 2304, 1152, 0.44, f"{MEGATRON}, weak scaling"),
    _megatron("462B", 144, 18432, 112, 8, 16, 6144, 3072, 0.47, f"{MEGATRON}, weak scaling"),
    _megatron("175B@96", 96, 12288, 96, 8, 6, 96, 1152, 0.47, f"{MEGATRON}, strong scaling (TP8 PP6 assumed)"),
    _megatron("175B@4608", 96, 12288, 96, 8, 6, 4608, 1152, 0.42, f"{MEGATRON}, strong scaling (TP8 PP6 assumed)"),
    _llama3("405B@8192", 8192, 1, 8192, 32, 0.43),
    _llama3("405B@16384", 16384, 1, 8192, 16, 0.41),
)

LONG_CONTEXT = _llama3("405B@16384 128K", 16384, 16, 131072, 16, 0.38)
"""Llama 3 405B's long-context row (module docstring): reported beside the scored runs, not among them."""


def _order(runs: Sequence[PublishedRun]) -> list[PublishedRun]:
    return sorted(runs, key=lambda r: (r.model.param_count(), r.gpus, r.name))


def halves(runs: Sequence[PublishedRun] = RUNS) -> tuple[tuple[PublishedRun, ...], tuple[PublishedRun, ...]]:
    """(fit half, held-out half): the runs not marked ``held_out`` sorted by parameter count then
    GPUs, alternate ones from the first to the fit half; every ``held_out`` run to the held-out
    half (after the others, in the same order)."""
    ordered = _order([r for r in runs if not r.held_out])
    return tuple(ordered[0::2]), tuple(ordered[1::2]) + tuple(_order([r for r in runs if r.held_out]))


def simulated_mfu(run: PublishedRun, eff: Efficiency | None = None) -> float:
    """The simulator's MFU for ``run`` (with ``eff`` in place of the catalog's Hopper constants)."""
    return run.simulated(eff).mfu


def with_values(values: Sequence[float], base: Efficiency | None = None) -> Efficiency:
    """``base`` (the catalog's H100 constants) with the ``FITTED`` fields set to ``values``."""
    eff = base if base is not None else parse_cluster("h100:8x1").device.eff
    return replace(eff, **dict(zip(FITTED, (float(v) for v in values), strict=True)))


def fit(runs: Sequence[PublishedRun]) -> tuple[float, ...]:
    """Values of ``FITTED`` minimising the squared relative MFU error over ``runs`` (within
    ``BOUNDS``), from the catalog's values; deterministic."""
    from scipy.optimize import least_squares  # NOTE: only the fit needs scipy; the simulator does not

    base = parse_cluster("h100:8x1").device.eff
    start = [getattr(base, f) for f in FITTED]
    scale = [hi - lo for lo, hi in BOUNDS]

    def residuals(x: Sequence[float]) -> list[float]:
        eff = with_values([v * s for v, s in zip(x, scale, strict=True)], base)
        return [simulated_mfu(r, eff) / r.mfu - 1.0 for r in runs]

    lo = [b[0] / s for b, s in zip(BOUNDS, scale, strict=True)]
    hi = [b[1] / s for b, s in zip(BOUNDS, scale, strict=True)]
    x0 = [min(max(v / s, a), b) for v, s, a, b in zip(start, scale, lo, hi, strict=True)]
    res = least_squares(residuals, x0, bounds=(lo, hi), diff_step=1e-3, xtol=1e-6, ftol=1e-8)
    return tuple(float(v * s) for v, s in zip(res.x, scale, strict=True))


@dataclass(frozen=True, slots=True)
class Score:
    """One run's published and simulated MFU, which half it belongs to, and the configuration scored."""

    run: PublishedRun
    half: str
    simulated: float
    config: ParallelConfig

    @property
    def error(self) -> float:
        """Relative MFU error: simulated / published - 1."""
        return self.simulated / self.run.mfu - 1.0


def scores(runs: Sequence[PublishedRun] = RUNS, eff: Efficiency | None = None) -> list[Score]:
    """Every run scored by the simulator (catalog constants unless ``eff``), in ``halves`` order:
    the fit half first."""
    fit_half, held = halves(runs)

    def score(run: PublishedRun, half: str) -> Score:
        res = run.simulated(eff)
        return Score(run, half, res.mfu, res.config)

    return [score(r, "fit") for r in fit_half] + [score(r, "held-out") for r in held]


def held_out_errors(all_scores: Sequence[Score]) -> tuple[float, float]:
    """(mean, max) absolute relative error over the held-out runs."""
    errs = [abs(s.error) for s in all_scores if s.half == "held-out"]
    return sum(errs) / len(errs), max(errs)
