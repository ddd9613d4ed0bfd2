"""Multi-rank equivalence: compiled loss, every gradient and the parameters after two AdamW steps
equal the single-device model (fp32), over worlds 1-8, 1-D/2-D/3-D meshes, models and plans."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist.conftest import RankPools

USER_PLAN = {"preset": "ddp+tp", "fc1.*": {"tp": "S(0)"}, "fc2.weight": {"tp": "S(1)"}, "fc3.weight": {"dp": "S(1)"}}

CASES: list[tuple[str, tuple[int, ...], tuple[str, ...], Any]] = [
    ("llama-tiny", (1,), ("dp",), "ddp"),
    ("mlp", (2,), ("dp",), "ddp"),
    ("gpt2-tiny", (2,), ("dp",), "fsdp"),
    ("llama-tiny", (2,), ("dp",), "fsdp"),
    ("llama-tiny", (2,), ("tp",), "tp"),
    ("gpt2-tiny", (2,), ("tp",), "tp"),
    ("mlp", (4,), ("tp",), "tp"),
    ("mlp", (4,), ("dp",), "fsdp"),
    ("llama-tiny", (2, 2), ("dp", "tp"), "fsdp+tp"),
    ("gpt2-tiny", (2, 2), ("dp", "tp"), "ddp+tp"),
    ("mlp", (2, 2), ("dp", "tp"), USER_PLAN),
    ("mlp", (8,), ("dp",), "fsdp"),
    ("llama-tiny", (2, 4), ("dp", "tp"), "fsdp+tp"),
    ("mlp", (2, 2, 2), ("dp", "fsdp", "tp"), "ddp+fsdp+tp"),
    ("deepseek-tiny", (2,), ("dp",), "fsdp"),
    ("deepseek-tiny", (2,), ("tp",), "tp"),
]
HF_CASES = [
    ("hf-llama", (2,), ("dp",), "fsdp"),
    ("hf-llama", (2, 2), ("dp", "tp"), "fsdp+tp"),
]


def _world(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _id(case: tuple[str, tuple[int, ...], tuple[str, ...], Any]) -> str:
    model, shape, names, plan = case
    mesh = ",".join(f"{n}={s}" for n, s in zip(names, shape, strict=True))
    return f"{model}-{mesh}-{plan if isinstance(plan, str) else 'user'}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_equivalence(rank_pools: RankPools, case: tuple[str, tuple[int, ...], tuple[str, ...], Any]) -> None:
    model, shape, names, plan = case
    results = rank_pools.get(_world(shape)).run(
        "tests.dist.cases:equivalence", model=model, shape=shape, names=names, plan=plan
    )
    assert len(results) == _world(shape)
    assert all(r["worst_grad_abs_diff"] <= 1e-5 for r in results)


def test_gradient_all_reduces_over_two_axes_run_bucketed(rank_pools: RankPools) -> None:
    # NOTE: data parallel over dp and the sequence split over cp: every gradient is all-reduced over
    # cp, then over dp; each block's run as one all-reduce per axis, the dp one reading the cp one's
    results = rank_pools.get(4).run(
        "tests.dist.cases:equivalence", model="llama-tiny", shape=(2, 2), names=("dp", "cp"), plan="ddp+cp"
    )
    for r in results:
        assert r["worst_grad_abs_diff"] <= 1e-5
        merged = {axis: n for name, axis, n in r["buckets"] if name == "comm.all_reduce_bucket"}
        assert set(merged) == {"dp", "cp"} and min(merged.values()) > 1, r["buckets"]


# NOTE: plan="auto": the solve picks every layout. With no memory bound the zoo's small models are
# cheapest replicated (no collectives beat their tiny matmuls); a memory bound under their
# replicated footprint (parameter, gradient and two Adam moments) forces parameter sharding.
AUTO_CASES: list[tuple[str, tuple[int, ...], tuple[str, ...], str | None, int | None]] = [
    ("mlp", (4,), ("dp",), None, 56 * 1024),
    ("mlp", (2, 2), ("a", "b"), None, 40 * 1024),
    ("mlp", (2, 2), ("dp", "tp"), "h100:8x1", 40 * 1024),
    ("llama-tiny", (2, 2), ("dp", "tp"), "h100:8x1", None),
]


@pytest.mark.parametrize(
    "case", AUTO_CASES, ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[3] or c[4]}" for c in AUTO_CASES]
)
def test_auto_plan_equivalence(
    rank_pools: RankPools, case: tuple[str, tuple[int, ...], tuple[str, ...], str | None, int | None]
) -> None:
    model, shape, names, cluster, memory = case
    results = rank_pools.get(_world(shape)).run(
        "tests.dist.cases:equivalence",
        model=model,
        shape=shape,
        names=names,
        plan="auto",
        cluster=cluster,
        memory=memory,
    )
    assert len(results) == _world(shape)
    layouts = results[0]["layouts"]
    assert all(r["layouts"] == layouts for r in results), "ranks compiled different plans"
    # NOTE: the plan report: one line per mesh axis (solved to a proven optimum), the step time, then
    # under a memory bound the memory pass's line
    report = results[0]["report"]
    assert all(r["report"] == report for r in results), [r["report"] for r in results]
    if memory is not None:
        assert report[-1].startswith("memory: policy auto under a budget of "), report
        report = report[:-1]
    assert [line.split(":")[0] for line in report[:-1]] == [f"mesh axis {a!r}" for a in names], report
    assert all("optimal after" in line and "gap 0.0" in line for line in report[:-1]), report
    assert report[-1].startswith("modelled step time "), report
    if memory is not None:
        assert any("S(" in lay for lay in layouts.values()), f"auto left every parameter replicated: {layouts}"


@pytest.mark.hf
@pytest.mark.parametrize("case", HF_CASES, ids=[_id(c) for c in HF_CASES])
def test_equivalence_hf(rank_pools: RankPools, case: tuple[str, tuple[int, ...], tuple[str, ...], Any]) -> None:
    model, shape, names, plan = case
    results = rank_pools.get(_world(shape)).run(
        "tests.dist.cases:equivalence", model=model, shape=shape, names=names, plan=plan
    )
    assert len(results) == _world(shape)


@pytest.mark.hf
@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "mistral", "phi3", "gemma"])
def test_more_hf_architectures_fsdp_tp(rank_pools: RankPools, arch: str) -> None:
    losses = rank_pools.get(4).run(
        "tests.dist.cases:hf_equivalence", arch=arch, shape=(2, 2), names=("dp", "tp"), plan="fsdp+tp"
    )
    assert len(set(losses)) == 1


@pytest.mark.hf
@pytest.mark.parametrize(("arch", "layers"), [("qwen2", 5), ("gpt2", 4)])
def test_deep_hf_models_whose_middle_layers_are_stamped_not_traced(
    rank_pools: RankPools, arch: str, layers: int
) -> None:
    # NOTE: capture traces layers 0, 1 and the last, and stamps the rest (tests/models/test_capture_depth.py
    # shows it does for these models); loss and every gradient must still be single device's
    losses = rank_pools.get(4).run(
        "tests.dist.cases:hf_equivalence", arch=arch, shape=(2, 2), names=("dp", "tp"), plan="fsdp+tp", layers=layers
    )
    assert len(set(losses)) == 1
