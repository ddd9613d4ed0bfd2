"""The mesh from a world size: ``parallelize(model, 4, example_inputs, plan="auto")``.

Every way of writing the world as named mesh axes is a candidate: each factorization of the rank
count into ``dp``, ``cp`` and ``tp`` axes (when the call gives ``pp=``, whose module trains by
``pm.step``, each that leads with a ``pp`` axis), in that order from the outermost axis in, so
``tp``, the axis that talks most, gets neighbouring ranks. Each is tried under every preset its
axis names allow and under ``plan="auto"``, compiled as a named mesh is: the sharding solve lays
out every value, the memory pass keeps the peak under the bound, a pipeline chooses its schedule
and stages. The per-op time model then prices the program it made (the replayed step,
``passes.schedule.timeline.predicted``; a pipeline's ``PipelinePlan.step_s``) and the liveness
model its peak (``passes.cost.liveness.rank_memory``); the fastest candidate whose peak fits wins,
ties going to the mesh with fewer axes, then to a preset. So the answer is a program, not a table
row: the winner's compile is the one the ranks lower.

A candidate the compile refuses (sizes that do not divide, a sequence too short to split, no
pipeline split that fits) stays in the report with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from meshfold import ir
from meshfold.passes import PassError
from meshfold.passes.cost.liveness import rank_memory, size_text
from meshfold.passes.options import Options
from meshfold.passes.schedule.timeline import predicted
from meshfold.passes.sharding.plans import AUTO, mesh_presets
from meshfold.passes.stages import PP, SplitError
from meshfold.session import CompileResult, compile_model

AXES = ("dp", "cp", "tp")
"""The axes a world is factored into, outermost first (``pp`` goes before them when asked for)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One mesh and plan for the world: its predicted step and peak per rank, or why it cannot run."""

    mesh: ir.Mesh
    plan: str
    step_s: float | None = None
    peak_bytes: float | None = None
    refused: str = ""

    @property
    def runs(self) -> bool:
        return not self.refused

    @property
    def label(self) -> str:
        """``dp=2,tp=2 fsdp+tp``: the mesh and the plan."""
        return f"{_shape(self.mesh)} {self.plan}"

    def describe(self) -> str:
        shape = self.label
        if self.refused:
            return f"{shape}: refused ({self.refused})"
        assert self.step_s is not None
        peak = "its stages split to fit" if self.peak_bytes is None else f"peak {size_text(self.peak_bytes)} per rank"
        return f"{shape}: predicted step {1e3 * self.step_s:.3f} ms, {peak}"


@dataclass(frozen=True, slots=True)
class WorldChoice:
    """Every candidate for a world, in the order they were priced, and the one chosen."""

    world: int
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    bound: float

    def lines(self) -> tuple[str, ...]:
        """The plan report's account of the choice: the winner and why, then every candidate."""
        ranked = sorted((c for c in self.candidates if c.runs), key=_rank)
        chosen = self.chosen
        assert chosen.step_s is not None
        why = "the only candidate that compiles and fits"
        if len(ranked) > 1:
            second = ranked[1]
            assert second.step_s is not None
            why = (
                f"the fastest predicted step of the {len(ranked)} that compile and fit "
                f"({second.step_s / chosen.step_s:.2f}x for the next, {second.label})"
            )
            ties = sum(1 for c in ranked if c.step_s == chosen.step_s) - 1
            if ties:
                why += f"; tied with {ties}: fewer axes first, then a preset before the solve's own layouts"
        unfit = sum(1 for c in self.candidates if c.refused.startswith("predicted peak"))
        bound = "" if math.isinf(self.bound) else f" under {size_text(self.bound)} per rank"
        head = (
            f"mesh: {chosen.label} chosen for {self.world} ranks from {len(self.candidates)} candidates{bound}: "
            f"{why}" + (f"; {unfit} do not fit memory" if unfit else "")
        )
        return (head, *(f"  {c.describe()}" for c in self.candidates))


def factorizations(world: int, pipeline: bool = False) -> list[ir.Mesh]:
    """Every mesh of ``world`` ranks over ``AXES``, each axis of at least 2 ranks, the axes in
    ``AXES`` order; one ``dp`` axis for a world of one. ``pipeline``: the meshes that lead with a
    ``pp`` axis instead (what a call with ``pp=`` trains on: its module steps by ``pm.step``)."""
    names = ((PP,) if pipeline else ()) + AXES
    out = [
        ir.Mesh(tuple(n for n, _ in axes), tuple(s for _, s in axes))
        for axes in _split(world, names)
        if axes and (axes[0][0] == PP) == pipeline
    ]
    return out or [ir.Mesh(("dp",), (world,))]


def plans(world: int, pipeline: bool = False) -> list[tuple[ir.Mesh, str]]:
    """Every (mesh, plan) candidate: each of ``factorizations`` under each preset its axis names allow
    (``plans.mesh_presets``: a ``dp`` axis is fsdp or ddp) and under ``auto``, the solve's own layouts
    (which may trade data parallelism away)."""
    out = []
    for mesh in factorizations(world, pipeline):
        rest = [(n, s) for n, s in zip(mesh.names, mesh.sizes, strict=True) if n != PP]
        pp = "pp+" if PP in mesh.names else ""
        if not rest:  # NOTE: a pipeline alone: one rank per stage, nothing else to lay out
            out += [(mesh, PP), (mesh, f"{PP}+{AUTO}")]
            continue
        presets = mesh_presets(ir.Mesh(tuple(n for n, _ in rest), tuple(s for _, s in rest)))
        out += [(mesh, pp + p) for p in [*presets, AUTO]]
    return out


def _split(n: int, names: Sequence[str]) -> Iterator[list[tuple[str, int]]]:
    if n == 1:
        yield []
        return
    for i, name in enumerate(names):
        for size in range(2, n + 1):
            if n % size == 0:
                for rest in _split(n // size, names[i + 1 :]):
                    yield [(name, size), *rest]


def choose(
    model: nn.Module, example_inputs: Sequence[Any], world: int, request: dict[str, Any]
) -> tuple[WorldChoice, CompileResult]:
    """Price every mesh of ``world`` ranks for ``model`` (``request``: the other keywords of the call,
    ``plan`` aside) and return the choice with the winner's compile. Raises ``PassError`` listing every
    candidate and its reason when none runs. Runs on one process (``parallelize`` runs it on rank 0)."""
    pipeline = request.get("pp") is not None
    captured: ir.Graph | None = None
    candidates: list[Candidate] = []
    compiled: dict[ir.Mesh, CompileResult] = {}
    bound = math.inf
    for mesh, plan in plans(world, pipeline):
        try:
            options = Options.of(mesh=mesh, plan=plan, **request)
            bound = options.memory if options.memory is not None else _device_memory(options)
            if options.pp is not None:
                from meshfold.pp.pipelined import microbatch  # NOTE: loads pipelining

                # NOTE: a pipeline's program is compiled for one microbatch, as ``parallelize`` does
                result = compile_model(model, microbatch(example_inputs, options.pp), options)
            else:
                source: nn.Module | ir.Graph = model if captured is None else captured
                result = compile_model(source, example_inputs if source is model else None, options)
                captured = result.captured  # NOTE: one capture serves every mesh without a pipeline
            cand = _priced(mesh, plan, result, options, bound)
        except (PassError, SplitError) as e:
            cand = Candidate(mesh, plan, refused=_first_line(e))
        candidates.append(cand)
        if cand.runs:
            compiled[cand.label] = result
    runs = [c for c in candidates if c.runs]
    if not runs:
        listed = "; ".join(c.describe() for c in candidates)
        raise PassError(f"no mesh of {world} ranks runs this model with plan='auto': {listed}")
    chosen = min(runs, key=_rank)
    return WorldChoice(world, tuple(candidates), chosen, bound), compiled[chosen.label]


def _priced(mesh: ir.Mesh, plan: str, result: CompileResult, options: Options, bound: float) -> Candidate:
    """The candidate from its compile: the predicted step and peak, refused over ``bound``."""
    if result.staged is not None:  # NOTE: plan_pipeline split the stages under the bound already
        return Candidate(mesh, plan, result.staged.step_s)
    step = predicted(result.graph, options.cluster).step
    peak = float(rank_memory(result.graph, cluster=options.cluster).peak)
    if peak > bound:
        return Candidate(mesh, plan, step, peak, f"predicted peak {size_text(peak)} over {size_text(bound)} per rank")
    return Candidate(mesh, plan, step, peak)


def _device_memory(options: Options) -> float:
    """The per-rank bound without ``memory=``: the cluster's device memory (unbounded for CPU ranks)."""
    return math.inf if options.cluster is None else float(options.cluster.device.hbm_bytes)


def _rank(c: Candidate) -> tuple[float, int, bool]:
    """Fastest first; at a tie fewer axes, then a preset before the solve's own layouts (then the
    order ``plans`` gives: ``min`` and ``sorted`` keep it)."""
    assert c.step_s is not None
    return (c.step_s, c.mesh.ndim, c.plan.endswith(AUTO))


def _shape(mesh: ir.Mesh) -> str:
    return ",".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes, strict=True))


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
