"""Cluster simulator, memory model, search and exports (analytic: milliseconds per case)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from meshfold.sim import (
    ConfigError,
    ParallelConfig,
    TrainSpec,
    gpt,
    parse_cluster,
    peak_memory,
    plot_memory,
    preset,
    search_configs,
    simulate,
    to_chrome_trace,
)
from meshfold.sim.calibration import RUNS, PublishedRun
from meshfold.sim.footprint import layer_activation_bytes
from meshfold.sim.layer import layer_cost
from meshfold.sim.model import ModelSpec
from meshfold.sim.simulate import layer_plan
from meshfold.sim.streams import LayerCost

GPT_16B = gpt("gpt-16b", 32, 6144, 48)
NODE = parse_cluster("h100:8x1")


def _layer(tp: int) -> LayerCost:
    cfg = ParallelConfig(dp=8 // tp, tp=tp)
    return layer_cost(GPT_16B, NODE, "bf16", "fp32", True, True, 4096, layer_plan(NODE, cfg), "dense")


def test_more_tp_cuts_compute_per_device_but_exposes_comm() -> None:
    costs = [_layer(tp) for tp in (1, 2, 4, 8)]
    compute = [c.fwd_s + c.bwd_s - c.fwd_exposed_s - c.bwd_exposed_s for c in costs]
    exposed = [c.fwd_exposed_s + c.bwd_exposed_s for c in costs]
    # NOTE: 8x less work per device, in GEMMs 8x smaller whose last wave of tiles wastes more (the fitted
    # gemm_mn_half), so a little under 6x less time
    assert compute == sorted(compute, reverse=True) and compute[-1] < compute[0] / 5.5
    assert exposed[0] == 0.0 and all(e > 0 for e in exposed[1:])
    assert exposed == sorted(exposed)


def test_pipeline_bubble_is_pp_minus_1_over_vpp_m() -> None:
    model, cluster = gpt("g", 32, 4096, 32), parse_cluster("h100:8x4")
    train = TrainSpec(4096, 64)
    for dp, pp, vpp in ((1, 4, 1), (1, 4, 2), (2, 2, 4)):
        cfg = ParallelConfig(dp=dp, tp=8, pp=pp, vpp=vpp)
        r = simulate(model, cluster, cfg, train)
        m = r.num_microbatches
        ideal = r.bubble_s / ((pp - 1) / vpp)  # one stage-pass of the slowest stage
        assert r.bubble_s / (m * ideal) == pytest.approx((pp - 1) / (vpp * m), rel=1e-9)
        gaps = [e.dur for e in r.events if e.category == "bubble"]
        assert len(gaps) == 1 and gaps[0] >= r.bubble_s * 0.99


def test_interleaving_shrinks_the_bubble_and_the_step() -> None:
    model, cluster, train = gpt("g", 32, 4096, 32), parse_cluster("h100:8x4"), TrainSpec(4096, 64)
    plain = simulate(model, cluster, ParallelConfig(dp=1, tp=8, pp=4), train, timeline=False)
    inter = simulate(model, cluster, ParallelConfig(dp=1, tp=8, pp=4, vpp=4), train, timeline=False)
    assert inter.bubble_s == pytest.approx(plain.bubble_s / 4, rel=0.01) and inter.step_time_s < plain.step_time_s


def test_memory_drops_with_zero_and_recompute() -> None:
    model, cluster, train = preset("llama3-8b"), parse_cluster("h100:8x2"), TrainSpec(8192, 64)
    by_zero = [peak_memory(model, cluster, ParallelConfig(dp=16, zero=z), train) for z in (0, 1, 2, 3)]
    totals = [m.total for m in by_zero]
    assert totals == sorted(totals, reverse=True) and totals[3] < totals[0] / 3
    assert by_zero[1].optimizer == pytest.approx(by_zero[0].optimizer / 16)
    acts = [
        peak_memory(model, cluster, ParallelConfig(dp=16, recompute=rc), train).activations
        for rc in ("none", "selective", "full")
    ]
    assert acts == sorted(acts, reverse=True) and acts[2] < acts[0] / 4
    full = simulate(model, cluster, ParallelConfig(dp=16, recompute="full"), train, timeline=False)
    none = simulate(model, cluster, ParallelConfig(dp=16), train, timeline=False)
    assert full.step_time_s > none.step_time_s * 1.2  # the forward runs twice


def test_gpt_activation_memory_is_korthikanti_32_sbh_over_t() -> None:
    model, train = GPT_16B, TrainSpec(4096, 8)
    s, b, h, t = 4096, 1, 6144, 4
    got = layer_activation_bytes(model, ParallelConfig(dp=2, tp=t), train, "dense")
    lse = 2 * s * (48 // t) * 4 / 2  # fp32 log-sum-exp per head, in bf16 elements x 2 bytes
    assert got == pytest.approx(32 * s * b * h / t + lse, rel=1e-9)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (ParallelConfig(dp=3, tp=2), r"tp\*cp\*dp\*pp == world"),
        (
            ParallelConfig(dp=1, tp=8, pp=1, vpp=1, micro_batch_size=1, cp=1, ep=1, zero=1, recompute="some"),
            "recompute",
        ),
        (ParallelConfig(dp=1, tp=8, pp=1, ep=2), "ep=2 needs a model with experts"),
        (ParallelConfig(dp=2, tp=2, pp=2, vpp=3), r"layers >= pp\*vpp violated: 4 layers cannot fill"),
        (ParallelConfig(dp=2, tp=4, micro_batch_size=3), r"global_batch % \(dp\*micro_batch_size\)"),
        (ParallelConfig(dp=1, tp=1, cp=8, pp=1), r"seq_len % \(2\*cp\)"),
    ],
)
def test_invalid_configs_name_the_constraint(cfg: ParallelConfig, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        simulate(gpt("g", 4, 512, 8), NODE, cfg, TrainSpec(24, 16))


def test_head_and_expert_constraints() -> None:
    cluster = parse_cluster("h100:8x2")
    with pytest.raises(ConfigError, match=r"heads % tp"):
        simulate(gpt("g", 4, 768, 12), cluster, ParallelConfig(dp=2, tp=8), TrainSpec(128, 16))
    mix = preset("mixtral-8x7b")
    with pytest.raises(ConfigError, match=r"num_experts % ep"):
        simulate(mix, cluster, ParallelConfig(dp=16, ep=16), TrainSpec(4096, 32))
    with pytest.raises(ConfigError, match=r"etp\*ep\*edp\*pp == world"):
        simulate(mix, cluster, ParallelConfig(dp=4, tp=2, pp=2, ep=8, etp=2), TrainSpec(4096, 32))


def test_moe_all_to_all_and_imbalance() -> None:
    mix, cluster, train = preset("mixtral-8x7b"), parse_cluster("h100:8x8"), TrainSpec(4096, 256)
    cfg = ParallelConfig(dp=16, tp=2, pp=2, ep=8, etp=1, zero=1)
    base = simulate(mix, cluster, cfg, train)
    assert any(e.category == "ep" for e in base.events)
    skewed = simulate(replace(mix, routing_imbalance=1.5), cluster, cfg, train, timeline=False)
    assert skewed.step_time_s > base.step_time_s
    assert base.mfu < 1.0 and base.fits


@pytest.mark.parametrize("run", [r for r in RUNS if "weak" in r.source], ids=lambda r: r.name)
def test_simulator_mfu_within_15_percent_of_megatron(run: PublishedRun) -> None:
    res = run.simulated()
    assert abs(res.mfu / run.mfu - 1) <= 0.15, res.summary()
    assert res.fits
    assert res.tflops_per_device == pytest.approx(res.mfu * 989.4, rel=1e-6)
    assert sum(v for _, v in res.breakdown) == pytest.approx(res.step_time_s, rel=1e-9)


def test_search_respects_memory_pins_and_is_deterministic() -> None:
    model, cluster, train = gpt("g", 24, 2048, 16), parse_cluster("h100:8x2"), TrainSpec(4096, 64)
    first = search_configs(model, cluster, train, top=8)
    again = search_configs(model, cluster, train, top=8)
    assert [r.config for r in first] == [r.config for r in again] and len(first) == 8
    assert all(r.result.peak_memory_bytes <= cluster.device.hbm_bytes for r in first)
    times = [r.result.step_time_s for r in first]
    assert times == sorted(times) and [r.rank for r in first] == list(range(1, 9))
    pinned = search_configs(model, cluster, train, fixed={"recompute": "full"}, mesh={"tp": 2, "pp": 2}, top=3)
    assert pinned and all(r.config.tp == 2 and r.config.pp == 2 and r.config.recompute == "full" for r in pinned)
    with pytest.raises(ValueError, match="unknown ParallelConfig fields"):
        search_configs(model, cluster, train, fixed={"tensor_parallel": 2})


def test_search_drops_configs_that_do_not_fit() -> None:
    model, cluster, train = preset("llama3-70b"), parse_cluster("h100:8x4"), TrainSpec(8192, 32)
    found = search_configs(model, cluster, train, top=50)
    assert found and all(r.result.fits for r in found)
    assert all(r.config.fsdp or r.config.pp > 1 or r.config.tp > 1 for r in found)
    assert not search_configs(preset("llama3-405b"), cluster, train, fixed={"zero": 0})


def test_chrome_trace_and_memory_plot(tmp_path: Path) -> None:
    model, cluster, train = gpt("g", 8, 1024, 16), parse_cluster("h100:8x1"), TrainSpec(2048, 16)
    res = simulate(model, cluster, ParallelConfig(dp=2, tp=2, pp=2, vpp=2), train)
    trace = to_chrome_trace(res)
    json.dumps(trace)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1}
    end = max(e["ts"] + e["dur"] for e in spans if e["tid"] == 0)
    assert end == pytest.approx(res.step_time_s * 1e6, rel=1e-6)
    assert max(p.nbytes for p in res.memory_timeline) <= res.peak_memory_bytes * 1.05
    pytest.importorskip("matplotlib")
    out = plot_memory(res, tmp_path / "mem.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="timeline"):
        to_chrome_trace(simulate(model, cluster, ParallelConfig(dp=2, tp=2, pp=2), train, timeline=False))


def _cp_layer(model: ModelSpec, method: str, cluster: str = "h100:8x2", seq: int = 32768) -> LayerCost:
    """One layer's cost at cp=16 over two nodes (the ring crosses the inter-node links)."""
    c = parse_cluster(cluster)
    cfg = ParallelConfig(dp=1, cp=16, cp_method=method)
    return layer_cost(model, c, "bf16", "fp32", True, True, seq, layer_plan(c, cfg), "dense")


def test_context_parallel_methods_trade_what_they_send() -> None:
    """Ring attention sends keys and values, TokenRing queries one way and outputs the other, so on a
    model without grouped-query keys (as many key heads as query heads) TokenRing waits less and
    with 4 query heads to a key head ring attention does; Ulysses' all-to-alls block the kernel, so
    they always show."""
    mha, gqa = GPT_16B, preset("llama3-8b")
    assert gqa.n_kv_heads * 4 == gqa.heads and GPT_16B.n_kv_heads == GPT_16B.heads
    short = 8192  # NOTE: short blocks leave the sends exposed
    mha_ring, mha_token = (_cp_layer(mha, m, seq=short) for m in ("ring", "tokenring"))
    gqa_ring, gqa_token = (_cp_layer(gqa, m, seq=short) for m in ("ring", "tokenring"))
    assert mha_token.fwd_exposed_s < mha_ring.fwd_exposed_s
    assert gqa_ring.fwd_exposed_s < gqa_token.fwd_exposed_s
    ulysses = _cp_layer(gqa, "ulysses")
    assert ulysses.fwd_exposed_s > 0 and ulysses.bwd_exposed_s > 0


def test_ulysses_needs_the_heads_to_divide_over_tp_and_cp() -> None:
    model = preset("llama3-8b")  # NOTE: 32 heads
    cluster = parse_cluster("h100:8x8")
    with pytest.raises(ConfigError, match=r"heads % \(tp\*cp\) == 0 violated: 32 heads over tp=2 x cp=32"):
        ParallelConfig(dp=1, tp=2, cp=32, cp_method="ulysses").validate(model, cluster, TrainSpec(131072, 1))
    with pytest.raises(ConfigError, match="cp_method 'striped' must be one of ring, tokenring, ulysses"):
        ParallelConfig(dp=1, cp=64, cp_method="striped").validate(model, cluster, TrainSpec(131072, 1))
    ParallelConfig(dp=2, cp=32, cp_method="ulysses").validate(model, cluster, TrainSpec(131072, 2))
