"""ONNX export on gloo ranks: each rank's forward program written as an ONNX file (``backends/onnx.py``)
and run with onnx's reference evaluator, its ``meshfold``-domain collectives over the same gloo
groups, computes what the compiled program computes; on one rank onnxruntime runs the file and
matches the single-device model to 1e-5; what the exporter cannot take is refused naming the op."""

from __future__ import annotations

import pytest

from tests.dist.conftest import RankPools

pytest.importorskip("onnx", reason="the onnx extra is not installed")
pytest.importorskip("onnxscript", reason="the onnx extra is not installed")

CASES = [("llama-tiny", "fsdp+tp"), ("gpt2-tiny", "ddp+tp")]


@pytest.mark.parametrize(("model", "plan"), CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_each_ranks_onnx_file_computes_its_program(rank_pools: RankPools, model: str, plan: str) -> None:
    out = rank_pools.get(4).run(
        "tests.dist.cases_onnx:exported_forward", model=model, plan=plan, shape=(2, 2), names=("dp", "tp")
    )
    assert [r["path"] for r in out] == [f"rank{i}.onnx" for i in range(4)]
    assert all(r["files"] == [r["path"]] for r in out)  # NOTE: each rank writes its own file, nothing else
    for r in out:
        # NOTE: tensor parallelism reduces and the data-parallel loss averages across ranks
        assert "AllReduce" in r["collectives"], r
        assert r["vs_compiled"] <= 1e-6, r
        assert r["vs_model"] <= 1e-5, r


def test_one_rank_file_runs_in_onnxruntime_as_the_model(rank_pools: RankPools) -> None:
    (r,) = rank_pools.get(1).run("tests.dist.cases_onnx:world_one_onnxruntime", model="llama-tiny")
    assert r["domains"] == ["ai.onnx"], r
    assert r["diff"] <= 1e-5, r


def test_expert_exchange_is_refused_naming_the_op(rank_pools: RankPools) -> None:
    out = rank_pools.get(4).run("tests.dist.cases_onnx:export_refused")
    assert all(message == out[0] for message in out)
    assert out[0].startswith("export_onnx cannot export meshfold.moe_experts at layers.0."), out[0]
    assert ".py:" in out[0] and "exchanges tokens between expert ranks" in out[0]
