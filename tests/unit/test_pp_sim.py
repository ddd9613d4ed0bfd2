"""Pipeline stages in the simulator: uneven splits, per-stage memory, schedules, search (analytic)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshfold.passes.stages import SplitError, split_layers
from meshfold.sim import ConfigError, ModelSpec, ParallelConfig, TrainSpec, gpt, parse_cluster, preset, simulate
from meshfold.sim.dataparallel import fsdp_floor
from meshfold.sim.footprint import stage_memory
from meshfold.sim.search import candidates, search_configs
from meshfold.sim.simulate import (
    Floors,
    pipeline_floor,
    pipeline_lower_bound,
    pipeline_time,
    stage_memories,
    step_lower_bound,
)
from meshfold.sim.stagesplit import _fits, _no_room


def test_llama3_405b_splits_126_layers_over_16_stages_like_the_paper() -> None:
    """With memory to spare (full recompute) the first and last stage hold one layer fewer, as the
    Llama 3 paper's 405B run did, to balance the embedding and the output head."""
    model, cluster = preset("llama3-405b"), parse_cluster("h100:8x64")
    cfg = ParallelConfig(dp=4, tp=8, pp=16, recompute="full")
    res = simulate(model, cluster, cfg, TrainSpec(8192, 512), timeline=False)
    assert res.stage_layers == (7, *[8] * 14, 7)
    assert "1F1B, stages: 7, 8x14, 7 layers" in res.summary()


def test_early_stages_hold_fewer_layers_when_memory_is_tight() -> None:
    """Without recompute, 1F1B stage s keeps pp - s micro-batches in flight: the balanced split moves
    layers to later stages so each fits, and every stage's own peak is reported."""
    model, cluster = preset("llama3-405b"), parse_cluster("h100:8x64")
    cfg = ParallelConfig(dp=4, tp=8, pp=16)
    res = simulate(model, cluster, cfg, TrainSpec(8192, 512), timeline=False)
    counts = res.stage_layers
    assert sum(counts) == 126 and counts[0] < counts[8] and res.fits
    assert len(res.stage_peak_bytes) == 16 and max(res.stage_peak_bytes) == res.peak_memory_bytes
    assert max(res.stage_peak_bytes) <= cluster.device.hbm_bytes
    even = simulate(model, cluster, replace(cfg, stage_split="even"), TrainSpec(8192, 512), timeline=False)
    assert not even.fits  # NOTE: equal layers overflow stage 0, which holds 16 micro-batches


def test_deepseek_v3_dense_first_layers_weigh_less() -> None:
    """61 layers, 3 dense then MoE: the stage holding the cheaper dense layers takes more of them."""
    model, cluster = preset("deepseek-v3"), parse_cluster("h100:8x128")
    cfg = ParallelConfig(dp=64, tp=1, pp=16, ep=64, etp=1, recompute="full")
    res = simulate(model, cluster, cfg, TrainSpec(4096, 1024), timeline=False)
    assert sum(res.stage_layers) == 61 and len(res.stage_layers) == 16
    assert res.stage_layers[0] > max(res.stage_layers[1:])  # NOTE: embedding + 3 dense + MoE layers


@pytest.mark.parametrize(("layers", "pp", "vpp"), [(30, 4, 1), (61, 16, 1), (126, 16, 1), (37, 4, 3), (10, 10, 1)])
def test_any_layer_count_over_any_pp_runs(layers: int, pp: int, vpp: int) -> None:
    model, cluster = gpt("g", layers, 2048, 16), parse_cluster(f"h100:8x{pp}")
    train = TrainSpec(4096, 16 * pp)
    res = simulate(model, cluster, ParallelConfig(dp=8, pp=pp, vpp=vpp), train)
    assert sum(res.stage_layers) == layers and min(res.stage_layers) >= vpp
    assert sum(v for _, v in res.breakdown) == pytest.approx(res.step_time_s, rel=1e-9)
    assert res.events[-1].start + res.events[-1].dur == pytest.approx(res.step_time_s, rel=1e-6)


def test_too_few_layers_for_the_chunks_is_a_clear_error() -> None:
    cluster = parse_cluster("h100:8x2")
    with pytest.raises(ConfigError, match=r"layers >= pp\*vpp violated: 6 layers cannot fill pp=4 x vpp=2 = 8"):
        simulate(gpt("g", 6, 1024, 16), cluster, ParallelConfig(dp=4, pp=4, vpp=2), TrainSpec(2048, 16))


def test_the_split_is_the_shared_rule_on_the_simulators_times() -> None:
    """The stages a simulation reports are split_layers' on the layer, embedding and head times."""
    from meshfold.sim.simulate import _costed

    model, cluster = gpt("g", 30, 4096, 32), parse_cluster("h100:8x4")
    cfg, train = ParallelConfig(dp=8, tp=1, pp=4), TrainSpec(4096, 64)
    c = _costed(model, cluster, cfg, train)
    layer = c.costs["dense"].fwd_s + c.costs["dense"].bwd_s
    emb, head = c.emb.fwd_s + c.emb.bwd_s, c.head.fwd_s + c.head.bwd_s
    assert c.stages.split.bounds == split_layers([layer] * 30, 4, head=emb, tail=head).bounds
    assert head > emb  # NOTE: the LM head and loss cost more than the lookup: the last stage is lighter
    assert simulate(model, cluster, cfg, train, timeline=False).stage_layers[-1] < 8


def test_zero_bubble_shrinks_only_the_bubble_by_the_weight_gradient_share() -> None:
    model, cluster, train = gpt("g", 32, 4096, 32), parse_cluster("h100:8x4"), TrainSpec(4096, 64)
    plain = simulate(model, cluster, ParallelConfig(dp=1, tp=8, pp=4), train, timeline=False)
    zb = simulate(model, cluster, ParallelConfig(dp=1, tp=8, pp=4, schedule="zb-h1"), train, timeline=False)
    assert 0.4 * plain.bubble_s < zb.bubble_s < 0.8 * plain.bubble_s  # NOTE: W is about 1/3 of F+B+W
    assert zb.step_time_s == pytest.approx(plain.step_time_s - plain.bubble_s + zb.bubble_s, rel=1e-9)
    assert zb.config.schedule_name == "ZB-H1" and "zb-h1" in zb.config.describe()
    with pytest.raises(ConfigError, match="schedule zb-h1 runs one chunk per stage"):
        simulate(model, cluster, ParallelConfig(dp=1, tp=8, pp=4, vpp=2, schedule="zb-h1"), train)


def test_search_tries_uneven_pp_and_every_schedule() -> None:
    model, cluster, train = gpt("g", 30, 2048, 16), parse_cluster("h100:8x4"), TrainSpec(4096, 96)
    seen = list(candidates(model, cluster, train))
    assert {c.pp for c in seen} >= {4, 8, 16}  # NOTE: none divides 30 layers
    assert {(c.schedule, c.vpp > 1) for c in seen if c.pp > 1} == {("1f1b", False), ("zb-h1", False), ("1f1b", True)}
    pinned = search_configs(model, cluster, train, mesh={"pp": 4, "tp": 8}, fixed={"schedule": "zb-h1"}, top=2)
    assert pinned and all(r.config.schedule == "zb-h1" and r.result.stage_layers for r in pinned)


def test_pruning_bound_never_exceeds_the_pipeline_time() -> None:
    model, cluster, train = preset("deepseek-v3"), parse_cluster("h100:8x128"), TrainSpec(4096, 1024)
    for cfg in (
        ParallelConfig(dp=64, pp=16, ep=64, etp=1, recompute="full"),
        ParallelConfig(dp=64, pp=16, ep=64, etp=1, recompute="full", schedule="zb-h1"),
        ParallelConfig(dp=32, pp=32, ep=32, etp=1, recompute="full"),
    ):
        assert pipeline_lower_bound(model, cluster, cfg, train) <= pipeline_time(model, cluster, cfg, train)
        assert len(stage_memories(model, cluster, cfg, train)) == cfg.pp


def test_every_bound_the_search_prunes_with_is_below_what_it_bounds() -> None:
    model, cluster, train = preset("deepseek-v3"), parse_cluster("h100:8x128"), TrainSpec(4096, 1024)
    floors = Floors(model, cluster, train)
    for cfg in (
        ParallelConfig(dp=64, pp=16, ep=64, etp=1, recompute="full", vpp=2),
        ParallelConfig(dp=32, tp=2, pp=16, ep=8, etp=2, recompute="selective", schedule="zb-h1"),
        ParallelConfig(dp=16, tp=2, cp=2, pp=16, ep=16, moe_mapping="unfolded", recompute="full"),
        ParallelConfig(dp=64, pp=16, ep=64, etp=1, zero=3, recompute="full"),
        ParallelConfig(dp=1024, ep=8, etp=1, zero=3, recompute="full", micro_batch_size=1),
    ):
        res = simulate(model, cluster, cfg, train, timeline=False)
        floor = pipeline_floor(model, cluster, cfg, train)
        assert floors(cfg) == floor  # NOTE: shared costs, keyed by what they read: the same floor
        assert floor.at(cfg.vpp, cfg.schedule) <= pipeline_time(model, cluster, cfg, train)
        assert step_lower_bound(model, cluster, cfg, train) <= res.step_time_s
        # NOTE: one floor for every expert layout: below each layout's own
        layouts = {(1, 1), (8, 8), (256, 1), (cfg.ep, cfg.etp_size)}
        for ep, etp in layouts:
            other = replace(cfg, ep=ep, etp=etp, moe_mapping="folded")
            coarse = floors.layouts(cfg, layouts).at(cfg.vpp, cfg.schedule)
            assert coarse <= pipeline_floor(model, cluster, other, train).at(cfg.vpp, cfg.schedule)
        exposed = dict(res.breakdown)["dp exposed"]
        dp = fsdp_floor(cluster, model, cfg, train, floor.m, floor.fwd, floor.bwd)
        assert dp <= exposed
        if cfg.zero == 3 and cfg.dp == 1024:
            assert dp >= 0.5 * exposed > 0  # NOTE: gathers over 1024 ranks are latency bound: the floor prunes them


def _exhaustive(
    model: ModelSpec, cluster: str, train: TrainSpec, top: int, fixed: dict[str, int]
) -> list[ParallelConfig]:
    """The ``top`` fastest configurations that fit, by simulating every candidate."""
    rows = []
    for cfg in candidates(model, parse_cluster(cluster), train, fixed=fixed):
        try:
            res = simulate(model, parse_cluster(cluster), cfg, train, timeline=False)
        except ConfigError:
            continue
        if res.fits:
            rows.append((res.step_time_s, res.peak_memory_bytes, repr(cfg), cfg))
    return [r[3] for r in sorted(rows, key=lambda r: r[:3])[:top]]


MOE6 = ModelSpec(
    "moe6", 6, 1024, 16, 2816, 32000, kv_heads=8, num_experts=8, top_k=2, moe_ffn_hidden=512, first_k_dense=1
)


@pytest.mark.parametrize(
    ("model", "cluster", "train"),
    [
        (preset("llama3-8b"), "h100:8x1", TrainSpec(8192, 32)),  # NOTE: memory binds: FSDP and pipelines lead
        (MOE6, "h100:8x1", TrainSpec(4096, 64)),  # NOTE: every ep and etp, both mappings, a dense layer
    ],
    ids=["dense-memory-bound", "moe"],
)
def test_the_pruned_search_ranks_as_simulating_every_candidate(
    model: ModelSpec, cluster: str, train: TrainSpec
) -> None:
    fixed = {"micro_batch_size": 1}
    found = search_configs(model, parse_cluster(cluster), train, fixed=fixed, top=8)
    assert len(found) == 8
    assert [r.config for r in found] == _exhaustive(model, cluster, train, 8, fixed)


def test_chunks_without_room_for_the_layers_have_no_split_that_fits() -> None:
    """``stagesplit._no_room`` lets the constrained split be skipped: wherever it says the chunks
    have no room, the split under memory finds none either; here it says so for about half the
    candidates, and the split finds one for most of the rest."""
    model, cluster, train = preset("deepseek-v3"), parse_cluster("h100:8x32"), TrainSpec(4096, 512)
    hbm, proved, found = cluster.device.hbm_bytes, 0, 0
    for cfg in candidates(
        model, cluster, train, fixed={"micro_batch_size": 1, "recompute": "none", "ep": 32, "etp": 1}
    ):
        if cfg.pp * cfg.vpp == 1 or cfg.vpp > 2:
            continue
        memory = stage_memory(model, cfg, train)
        no_room = _no_room(model, cfg, memory, hbm)
        proved += no_room
        try:
            split_layers([1.0] * model.layers, cfg.pp * cfg.vpp, fits=_fits(model, cfg, memory, hbm))
        except SplitError:
            continue
        found += 1
        assert not no_room, cfg.describe()
    assert proved > 100 and found > 100, (proved, found)
