"""Outputs and gradients as on one device: ``.grad`` stays None on parameters no backward reaches (so
AdamW leaves them alone), and non-tensor outputs come back in the model's own structure."""

from __future__ import annotations

import pytest

from tests.dist.conftest import RankPools


@pytest.mark.parametrize(("plan", "which"), [("ddp", 0), ("fsdp", 1), ("fsdp", 2)])
def test_grad_is_none_where_backward_does_not_reach(rank_pools: RankPools, plan: str, which: int) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_outputs:grads_where_reached", plan=plan, which=which)
    unreached = {0: ["b.bias", "b.weight", "frozen", "side.bias", "side.weight"]}
    unreached[1] = ["a.bias", "a.weight", "frozen", "side.bias", "side.weight"]
    unreached[2] = ["a.bias", "a.weight", "b.bias", "b.weight", "frozen"]
    assert [r["no_grad"] for r in results] == [unreached[which]] * 4


@pytest.mark.parametrize("as_dict", [True, False], ids=["dict", "tuple"])
def test_non_tensor_outputs_pass_through(rank_pools: RankPools, as_dict: bool) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_outputs:non_tensor_outputs", plan="fsdp", as_dict=as_dict)
    want = ["logits", "loss", "n", "name"] if as_dict else 4
    assert [r["keys"] for r in results] == [want] * 4
