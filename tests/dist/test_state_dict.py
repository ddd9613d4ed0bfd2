"""``pm.model_state_dict()`` after training loads into a fresh single-device model with ``strict=True``
and gives it the trained weights (non-persistent buffers and tied weights included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.conftest import RankPools


@pytest.mark.parametrize(
    ("model", "plan", "steps"),
    [("llama-tiny", "fsdp+tp", 2), ("gpt2-tiny", "ddp+tp", 1)],
    ids=["llama-tiny-fsdp+tp", "gpt2-tiny-ddp+tp"],
)
def test_model_state_dict_loads_strictly(rank_pools: RankPools, model: str, plan: str, steps: int) -> None:
    results = rank_pools.get(4).run(
        "tests.dist.cases_state:state_dict_round_trip",
        model=model,
        shape=(2, 2),
        names=("dp", "tp"),
        plan=plan,
        steps=steps,
    )
    assert len(results) == 4
    for r in results:
        assert r["worst"] <= 5e-5
        assert r["moved"] > 1e-4  # NOTE: training changed the weights, so loading them is observable


@pytest.mark.parametrize(("model", "plan"), [("llama-tiny", "fsdp+tp"), ("gpt2-tiny", "ddp+tp")])
def test_dcp_checkpoints_cross_between_single_device_and_compiled(rank_pools: RankPools, model: str, plan: str) -> None:
    results = rank_pools.get(4).run(
        "tests.dist.cases_state:dcp_round_trip", model=model, shape=(2, 2), names=("dp", "tp"), plan=plan
    )
    assert len(results) == 4
    for r in results:
        assert max(r.values()) <= 5e-5


@pytest.mark.parametrize(
    ("shape", "names", "plan", "batch"), [((4,), ("tp",), "tp", 2), ((4,), ("dp",), "ddp", 4)], ids=["tp", "ddp"]
)
def test_dcp_checkpoint_of_fsdp_tp_resumes_on_another_mesh(
    rank_pools: RankPools, tmp_path: Path, shape: tuple[int, ...], names: tuple[str, ...], plan: str, batch: int
) -> None:
    results = rank_pools.get(4).run(
        "tests.dist.cases_state:dcp_across_meshes",
        where=str(tmp_path / "ckpt"),
        shape=shape,
        names=names,
        plan=plan,
        batch=batch,
    )
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert any(f"{names[0]}: S(" in lay for lay in results[0]["layouts"]), results[0]["layouts"]


@pytest.mark.hf
def test_hf_save_pretrained_round_trip(rank_pools: RankPools) -> None:
    pytest.importorskip("transformers")
    results = rank_pools.get(4).run(
        "tests.dist.cases_state:hf_save_pretrained", shape=(2, 2), names=("dp", "tp"), plan="fsdp+tp", steps=2
    )
    assert results[1:] == [{}, {}, {}]
    assert results[0]["moved"] > 1e-4  # NOTE: training changed the weights, so loading them is observable
    assert results[0]["worst"] <= 1e-5


def test_async_checkpoint_resumes_on_another_plan_skipping_a_cut_write(rank_pools: RankPools, tmp_path: Path) -> None:
    results = rank_pools.get(2).run("tests.dist.cases_state:async_checkpoint_resumes", where=str(tmp_path / "ckpt"))
    assert len(results) == 2
    assert results[0]["losses"] == results[1]["losses"]
    assert {"COMPLETE.json", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(results[0]["files"])


def test_train_resumes_under_a_fixed_plan_and_refuses_one_that_no_longer_fits(
    rank_pools: RankPools, tmp_path: Path
) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_state:train_resumes_under_a_fixed_plan", where=str(tmp_path))
    for r in results:
        assert r["meshes"] == [(("dp", 2), ("tp", 2)), (("dp", 1), ("tp", 4))]
        assert r["starts"] == [0, 4]
        assert "tp=3" in r["refused"] and "4 ranks there are now" in r["refused"], r["refused"]
