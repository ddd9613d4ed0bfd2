"""The simulator's fitted constants against the published runs: fitted on one half, scored on the other."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshfold.sim import calibration, parse_cluster, simulate
from meshfold.sim.calibration import FITTED, GOAL, RUNS, fit, halves, held_out_errors, scores


def test_split_rule_alternates_by_size_and_covers_every_run() -> None:
    fit_half, held = halves()
    assert sorted(r.name for r in fit_half + held) == sorted(r.name for r in RUNS)
    ordered = sorted(RUNS, key=lambda r: (r.model.param_count(), r.gpus, r.name))
    assert [r.name for r in fit_half] == [r.name for r in ordered[0::2]]
    assert len(fit_half) - len(held) in (0, 1) and not set(fit_half) & set(held)


def test_held_out_error_as_the_bench_computes_it() -> None:
    all_scores = scores()
    mean, worst = held_out_errors(all_scores)
    assert mean <= GOAL, [f"{s.run.name} {s.error:+.1%}" for s in all_scores]
    assert worst <= GOAL
    assert all(abs(s.error) <= 0.10 for s in all_scores if s.half == "fit")


@pytest.fixture(scope="module")
def fitted() -> tuple[float, ...]:
    return fit(halves()[0])


def test_catalog_constants_are_the_fit_on_the_fit_half(fitted: tuple[float, ...]) -> None:
    eff = parse_cluster("h100:8x1").device.eff
    for name, value in zip(FITTED, fitted, strict=True):
        assert getattr(eff, name) == pytest.approx(value, rel=0.01), name


def test_the_fit_reads_only_the_fit_half(fitted: tuple[float, ...]) -> None:
    """Changing a held-out run's published MFU leaves the fit as it was; changing a fit-half run's
    moves it."""
    fit_half, held = halves()
    moved_held = [replace(r, mfu=r.mfu * 1.5) for r in held]
    assert halves([*fit_half, *moved_held])[0] == fit_half
    assert fit(halves([*fit_half, *moved_held])[0]) == pytest.approx(fitted, rel=1e-9)
    moved_fit = [replace(r, mfu=r.mfu * 0.8) if i == 0 else r for i, r in enumerate(fit_half)]
    assert fit(halves([*moved_fit, *held])[0]) != pytest.approx(fitted, rel=1e-3)


def test_every_published_run_has_a_source_and_a_valid_plan() -> None:
    for run in RUNS:
        for config in run.configs():
            config.validate(run.model, run.cluster(), run.train)
        assert run.source.startswith(calibration.MEGATRON) and 0 < run.mfu < 1


def test_pipelined_runs_are_scored_interleaved_with_their_fastest_chunk_count() -> None:
    """Megatron-LM overlaps pipeline sends only under interleaved 1F1B: every PP run is scored with
    more than one chunk per stage, the count the simulator finds fastest among those its layers allow."""
    for run in RUNS:
        per_stage = run.model.layers // run.config.pp
        if run.config.pp == 1:
            assert run.vpps == (1,)
            continue
        assert run.vpps and all(v > 1 and per_stage % v == 0 for v in run.vpps)
        best = run.simulated()
        assert best.config.vpp in run.vpps
        others = [simulate(run.model, run.cluster(), c, run.train, timeline=False) for c in run.configs()]
        assert all(best.step_time_s <= r.step_time_s for r in others)
