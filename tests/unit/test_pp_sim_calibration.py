"""The simulator's fitted constants against the published runs: fitted on one half, scored on the other."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshfold.passes.cost import calibration, parse_cluster
from meshfold.passes.cost.calibration import FITTED, GOAL, RUNS, fit, halves, held_out_errors, scores

# NOTE: the GPT-3 175B strong-scaling ends (96 and 4,608 GPUs) miss GOAL under the published-plan
# assumptions (plain 1F1B at TP8 PP6); this is the largest held-out error reached, not a target.
HELD_OUT_MAX = 0.19


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
    assert worst <= HELD_OUT_MAX
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
        run.config.validate(run.model, run.cluster(), run.train)
        assert run.source.startswith(calibration.MEGATRON) and 0 < run.mfu < 1
