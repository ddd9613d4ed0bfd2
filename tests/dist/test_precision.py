"""Mixed precision on ranks: each policy against one device under the same policy, and beside
torch's FSDP2 with the same ``MixedPrecisionPolicy`` (tests/dist/cases_precision.py)."""

from __future__ import annotations

import statistics

import pytest

from tests.dist.conftest import RankPools


@pytest.mark.parametrize("precision", ["bf16", "bf16-reduce"])
def test_fsdp_gradients_are_the_slices_bf16_gradients_reduced_in_the_policys_dtype(
    rank_pools: RankPools, precision: str
) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_precision:fsdp_sums", precision=precision)
    said = results[0]
    assert all(r == said for r in results), results
    assert said["parameters"] == said["gradients"] == ["torch.float32"]  # NOTE: master weights and their grads
    assert said["gather bytes ratio"] == 0.5  # NOTE: every parameter all-gathered in bf16
    assert said["loss within 3U"]
    assert said["equals the sum of the slices"], said
    assert said["within the bound of the whole batch"], said
    assert said["bf16 values"] == (precision == "bf16-reduce")  # NOTE: a bf16 reduction leaves bf16 values


def test_fsdp_tp_stays_within_bf16s_own_distance_of_the_one_device_policy_step(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_precision:tp_errors")
    said = results[0]
    assert all(r == said for r in results), results
    assert said["parameters"] == ["torch.float32"]
    assert said["loss error"] <= said["loss error of bf16"], said
    assert said["normwise"] <= 2 * said["normwise of bf16"], said
    assert said["normwise from fp32"] >= 0.5 * said["normwise of bf16"], said  # NOTE: it computes in bf16


def test_fifty_steps_beside_fsdp2_with_the_same_policy(rank_pools: RankPools) -> None:
    curves = rank_pools.get(4).run("tests.dist.cases_precision:beside_fsdp2", steps=50)[0]
    ours = [abs(a - b) for a, b in zip(curves["meshfold"], curves["single"], strict=True)]
    theirs = [abs(a - b) for a, b in zip(curves["fsdp2"], curves["single"], strict=True)]
    # NOTE: both drift from one device as bf16 rounding compounds over the steps; meshfold by no more than FSDP2
    assert statistics.mean(ours) <= 1.25 * statistics.mean(theirs), (statistics.mean(ours), statistics.mean(theirs))
    assert curves["meshfold"][-1] < curves["meshfold"][0] - 1.0  # NOTE: it trains


def test_a_policy_that_cannot_apply_is_refused_on_every_rank(rank_pools: RankPools) -> None:
    results = rank_pools.get(2).run("tests.dist.cases_precision:refusals")
    assert results[0] == results[1]
    bf16_model, verified = results[0]
    assert "fc1.weight is torch.bfloat16" in bf16_model and "model.float()" in bf16_model
    assert "verify=True" in verified


PLANS = [("fsdp", (2,), ("dp",)), ("tp", (2,), ("tp",)), ("fsdp+tp", (2, 2), ("dp", "tp"))]


@pytest.mark.parametrize(("plan", "shape", "names"), PLANS, ids=[p for p, _, _ in PLANS])
def test_float8_tensorwise_equals_one_device(rank_pools: RankPools, plan: str, shape: tuple, names: tuple) -> None:
    results = rank_pools.get(4 if len(shape) == 2 else 2).run(
        "tests.dist.cases_precision:float8", shape=shape, names=names, plan=plan
    )
    said = results[0]
    assert all(r == said for r in results), results
    assert said["scaled mm"] == 5  # NOTE: every gemm of the two Float8Linears (the input needs no gradient)
    assert all(name in said["layouts"][p] for p in ("up.weight", "down.weight") for name in names), said["layouts"]
    assert said["loss error"] <= 1e-6 and said["normwise"] <= 1e-6, said  # NOTE: fp32 rounding only
    assert said["normwise of float8"] > 0.01  # NOTE: float8 does change the step: the test sees what it casts
    if "dp" in names:  # NOTE: each weight is cast on its shard and gathered as float8: a quarter of fp32's bytes
        assert said["gathered"] == ["torch.float8_e4m3fn"], said
        assert said["gather bytes"] == 0.25 * said["gather bytes without float8 gathers"] > 0, said


@pytest.mark.parametrize(("plan", "shape", "names"), PLANS, ids=[p for p, _, _ in PLANS])
def test_float8_rowwise_is_nearer_one_device_than_float8_is_to_fp32(
    rank_pools: RankPools, plan: str, shape: tuple, names: tuple
) -> None:
    world = 4 if len(shape) == 2 else 2
    results = rank_pools.get(world).run(
        "tests.dist.cases_precision:float8", shape=shape, names=names, plan=plan, recipe="rowwise"
    )
    said = results[0]
    assert all(r == said for r in results), results
    # NOTE: the rowwise gemms write bf16: a product split over its contraction rounds each part
    # once more (2^-8 of it), which can move a later float8 cast by one step of its own; so the
    # program is nearer the one-device float8 step than float8 is to the unconverted model
    assert said["normwise"] <= 0.5 * said["normwise of float8"], said
    assert said["loss error"] <= 2.0**-8, said


def test_a_host_without_float8_matmuls_refuses_a_float8_model_naming_the_op(rank_pools: RankPools) -> None:
    said = rank_pools.get(2).run("tests.dist.cases_precision:no_float8_host")
    # NOTE: rank 0 compiles and raises; the others raise what it sent them
    assert said[1] == f"compilation failed on rank 0: PassError: {said[0]}"
    assert "aten._scaled_mm at up (fwd, float8_linear.py" in said[0] and "cannot run float8 matmuls on cpu" in said[0]
