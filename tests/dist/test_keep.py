"""What users do with a compiled module beyond plain training steps, on gloo ranks and compared with the
single-device model: a wrong input dtype, a shape bug in the model, a hidden size tp cannot split,
gradient accumulation, gradient clipping, bf16 models, the same compiled graph in every process, and a
rank killed mid-training."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from meshfold.passes.options import Options
from meshfold.session import compile_model
from meshfold.tools.pool import RankFailure
from meshfold.tools.zoo import build
from tests.dist.conftest import RankPools

CASES = "tests.dist.cases_keep"


def test_bf16_input_to_an_fp32_model_raises_on_every_rank(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run(f"{CASES}:bf16_input_to_fp32_model")
    said = results[0]["said"]
    assert all(r["said"] == said for r in results), "ranks raised different errors"
    assert "input 'x' is bf16" in said and "f32" in said, said
    assert "BFloat16" in results[0]["single"]  # NOTE: one device refuses the call as well


def test_a_broadcasting_bug_is_reported_as_a_shape_error(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run(f"{CASES}:broadcasting_bug")
    for rank, r in enumerate(results):
        said = r["said"]
        assert "mutation" not in said and "in-place" not in said, f"rank {rank}: {said}"
        assert "`+` on operands of shapes [8, 4] and [3]" in said, f"rank {rank}: {said}"
        assert "in module `inner`" in said and "cases_keep.py:" in said, f"rank {rank}: {said}"
        assert "must match" in r["single"]


def test_tp_on_a_hidden_size_tp_does_not_divide_warns_and_trains(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run(f"{CASES}:indivisible_hidden", hidden=30)
    # NOTE: rank 0 compiles for every rank, so its warnings are the ones a user sees
    said = results[0]["warnings"]
    assert [w.split(" ")[3] for w in said] == ["fc1.weight", "fc1.bias", "fc2.weight"], said
    assert all("size 30" in w and "4 ranks of mesh axis 'tp'" in w for w in said), said
    assert all(r["layouts"] == results[0]["layouts"] for r in results)
    assert all(results[0]["layouts"][n] == "{}" for n in ("fc1.weight", "fc1.bias", "fc2.weight"))


def test_gradient_accumulation_equals_single_device(rank_pools: RankPools) -> None:
    totals = rank_pools.get(4).run(f"{CASES}:gradient_accumulation", micro=3, steps=2)
    assert len(set(totals)) == 1


def test_clip_grad_norm_equals_single_device(rank_pools: RankPools) -> None:
    norms = rank_pools.get(4).run(f"{CASES}:clip_grad_norm", max_norm=0.05, steps=2)
    assert all(n == norms[0] for n in norms) and all(x > 0.05 for x in norms[0])


def test_bf16_model_trains_like_single_device(rank_pools: RankPools) -> None:
    worst = rank_pools.get(4).run(f"{CASES}:bf16_model", steps=2)
    assert all(w == worst[0] for w in worst)


def test_compiled_graph_text_is_byte_identical_across_processes(rank_pools: RankPools) -> None:
    args = {"model": "llama-tiny", "mesh": "dp=2,tp=2", "plan": "fsdp+tp"}
    results = rank_pools.get(2).run(f"{CASES}:graph_digest", **args)
    net, inputs = build(args["model"])
    here = compile_model(net, inputs, Options.of(mesh=args["mesh"], plan=args["plan"])).graph
    digests = {d for d, _ in results} | {hashlib.sha256(str(here).encode()).hexdigest()}
    assert len(digests) == 1
    if "PYTHONHASHSEED" not in os.environ:
        # NOTE: the processes hash strings differently, so nothing depends on set or dict-of-str order by luck
        assert len({h for _, h in results} | {hash("meshfold")}) > 1


def test_a_killed_rank_surfaces_on_the_others_within_a_second(rank_pools: RankPools, tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as info:
        rank_pools.get(4).run(f"{CASES}:killed_rank", where=str(tmp_path), victim=3)
    assert "rank died (exit code -9, SIGKILL)" in info.value.failures[3]
    for rank in (0, 1, 2):
        report = tmp_path / f"rank{rank}"
        assert report.exists(), f"rank {rank} did not raise: {info.value}"
        seconds, error = report.read_text().split(" ", 1)
        assert float(seconds) < 1.0, f"rank {rank} raised {seconds} s after the kill: {error}"
