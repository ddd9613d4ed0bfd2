"""The simulator's fitted constants against the published runs: fitted on one half, scored on the other."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshfold.sim import calibration, parse_cluster, simulate
from meshfold.sim.calibration import FITTED, GOAL, RUNS, fit, halves, held_out_errors, scores
from meshfold.sim.parallel import ParallelConfig


def test_split_rule_alternates_by_size_and_covers_every_run() -> None:
    fit_half, held = halves()
    assert sorted(r.name for r in fit_half + held) == sorted(r.name for r in RUNS)
    candidates = [r for r in RUNS if not r.held_out]
    ordered = sorted(candidates, key=lambda r: (r.model.param_count(), r.gpus, r.name))
    assert [r.name for r in fit_half] == [r.name for r in ordered[0::2]]
    assert [r.name for r in held if not r.held_out] == [r.name for r in ordered[1::2]]
    assert len(fit_half) - len(ordered[1::2]) in (0, 1) and not set(fit_half) & set(held)
    assert all(r.held_out for r in held[len(ordered[1::2]) :])


def test_the_fit_half_is_the_four_megatron_runs_the_constants_were_fitted_on() -> None:
    """Adding published runs never moves the fit half: they are held out."""
    assert [r.name for r in halves()[0]] == ["1.7B", "70B", "177B", "462B"]
    assert {r.name for r in RUNS if r.held_out} == {"405B@8192", "405B@16384"}
    assert halves([*RUNS, calibration.LONG_CONTEXT])[0] == halves()[0]


def test_every_held_out_run_is_within_the_goal() -> None:
    """Each held-out run on its own, thousands of GPUs included (Llama 3 405B on 8,192 and 16,384 H100)."""
    held = [s for s in scores() if s.half == "held-out"]
    assert len(held) == 5 and max(s.run.gpus for s in held) == 16384
    assert all(abs(s.error) <= GOAL for s in held), [f"{s.run.name} {s.error:+.1%}" for s in held]


def test_llama3_runs_are_the_published_table_rows() -> None:
    """GPUs, TP / CP / PP / DP, sequence, 16M tokens a step and MFU as Table 4 of the Llama 3 paper has them,
    the paper's stage layout (one layer fewer on the first and last stage, edges alone in their chunks)
    and its sharding (gradients and optimizer state over DP); the runs fit an 80 GB H100 at DP 128."""
    rows = {r.name: r for r in (*RUNS, calibration.LONG_CONTEXT) if r.source.startswith(calibration.LLAMA3)}
    table = {
        "405B@8192": (8192, 8, 1, 16, 64, 8192, 0.43),
        "405B@16384": (16384, 8, 1, 16, 128, 8192, 0.41),
        "405B@16384 128K": (16384, 8, 16, 16, 8, 131072, 0.38),
    }
    assert set(rows) == set(table)
    for name, (gpus, tp, cp, pp, dp, seq, mfu) in table.items():
        run = rows[name]
        c = run.config
        assert (run.gpus, c.tp, c.cp, c.pp, c.dp, run.train.seq_len, run.mfu) == (gpus, tp, cp, pp, dp, seq, mfu)
        assert run.train.tokens == 16 * 2**20 and run.model.param_count() == pytest.approx(405e9, rel=0.01)
        assert c.zero == 2 and c.recompute == "none" and run.train.grad_dtype == "fp32"
        res = run.simulated()
        assert res.stage_layers == (7, *[8] * 14, 7)
        if dp == 128:
            assert res.fits, f"{name}: {res.peak_memory_bytes / 1e9:.1f} GB"


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
        assert run.source.startswith((calibration.MEGATRON, calibration.LLAMA3)) and 0 < run.mfu < 1


def test_pipelined_runs_are_scored_interleaved_with_their_fastest_chunk_count() -> None:
    """Megatron-LM overlaps pipeline sends only under interleaved 1F1B: every PP run is scored with
    more than one chunk per stage, the count the simulator finds fastest among those its layers allow."""
    for run in RUNS:
        if run.held_out:
            continue  # NOTE: Llama 3's chunk count is published (one layer a chunk), not searched
        per_stage = run.model.layers // run.config.pp
        if run.config.pp == 1:
            assert run.vpps == (1,)
            continue
        assert run.vpps and all(v > 1 and per_stage % v == 0 for v in run.vpps)
        best = run.simulated()
        assert best.config.vpp in run.vpps
        others = [simulate(run.model, run.cluster(), c, run.train, timeline=False) for c in run.configs()]
        assert all(best.step_time_s <= r.step_time_s for r in others)


def test_activations_in_flight_walk_the_interleaved_order() -> None:
    """Equal chunks: the warm-up count times a chunk; a chunk with only the embedding holds nothing."""
    from meshfold.sim.footprint import chunks_in_flight, peak_in_flight

    for pp, vpp, m, rank in ((16, 8, 32, 1), (16, 8, 16, 0), (4, 1, 8, 2), (6, 16, 24, 5)):
        cfg = ParallelConfig(pp=pp, vpp=vpp)
        assert peak_in_flight(pp, vpp, m, rank, (1.0,) * vpp) == chunks_in_flight(cfg, m, rank)
    # NOTE: rank 0 of 126 layers over 16 x 8 chunks keeps 143 chunk-passes in flight, 31 of them the
    # embedding's (16 of the first round, 15 of the next): 16 micro-batches of its 7 layers
    assert peak_in_flight(16, 8, 32, 0, (0.0, *[1.0] * 7)) == 143 - 31 == 16 * 7


def test_zero2_reductions_run_on_behind_the_next_micro_batch() -> None:
    from meshfold.sim.dataparallel import _hide, lagging_reduce

    assert lagging_reduce(0.2, 0.3, 0.45, 32, 4, True) == pytest.approx(_hide(0.2, 0.3, 4, True))
    assert lagging_reduce(0.5, 0.3, 0.45, 32, 4, True) == pytest.approx(31 * 0.05 + _hide(0.5, 0.3, 4, True))
    assert lagging_reduce(0.2, 0.3, 0.45, 32, 4, False) == pytest.approx(32 * 0.2)
