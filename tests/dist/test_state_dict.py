"""``pm.model_state_dict()`` after training loads into a fresh single-device model with ``strict=True``
and gives it the trained weights (non-persistent buffers and tied weights included)."""

from __future__ import annotations

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
