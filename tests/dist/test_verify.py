"""``parallelize(..., verify=True)`` checks the first step value by value against the single-device model."""

from __future__ import annotations

from tests.dist.conftest import RankPools


def test_verify_passes_on_a_correct_compilation(rank_pools: RankPools) -> None:
    errors = rank_pools.get(4).run(
        "tests.dist.cases:verify_mode", model="llama-tiny", shape=(2, 2), names=("dp", "tp"), plan="fsdp+tp"
    )
    assert errors == ["", "", "", ""]


def test_verify_checks_ring_attention_step_by_step(rank_pools: RankPools) -> None:
    """Ring attention written as its steps (``passes/cp/steps.py``): every rank's keys after each pass,
    each step's partial output and each merge agree with the whole-tensor reference."""
    errors = rank_pools.get(4).run(
        "tests.dist.cases:verify_mode", model="llama-tiny", shape=(4,), names=("cp",), plan="cp", cp="ring"
    )
    assert errors == ["", "", "", ""]


def test_verify_names_the_first_value_that_differs(rank_pools: RankPools) -> None:
    errors = rank_pools.get(2).run(
        "tests.dist.cases:verify_mode", model="mlp", shape=(2,), names=("tp",), plan="tp", corrupt="fc2.weight"
    )
    # NOTE: ranks name the same value; only the detail (this rank's own difference) may differ.
    shared = [e.split("); ")[0] for e in errors]
    assert shared[0] == shared[1] != ""
    assert "largest difference 1 at local index" in errors[1]
    msg = errors[0]
    assert msg.startswith("forward: the first value that differs from the single-device model is %")
    # NOTE: fc2 is row-parallel; the first value computed from the corrupted shard is fc2's matmul.
    assert "at fc2 (fwd, models.py:" in msg and "{tp: S(1)}" in msg


def test_decorator_form(rank_pools: RankPools) -> None:
    losses = rank_pools.get(2).run("tests.dist.cases:decorated", plan="fsdp")
    assert losses[0] == losses[1] > 0


def test_decorated_class_in_the_usual_order(rank_pools: RankPools) -> None:
    losses = rank_pools.get(2).run("tests.dist.cases:decorated_usual_order")
    assert losses[0] == losses[1] > 0


def test_verify_checks_every_stage_of_a_pipeline(rank_pools: RankPools) -> None:
    """Pipelines: each rank checks its stages' values for the first microbatch (forward, the input's
    gradient and, under zero bubble, the weights' gradients computed later) against the whole
    program; correct programs pass under each schedule."""
    for names, plan, pp in [
        (("pp", "tp"), "pp+tp", {"schedule": "1f1b", "microbatches": 2}),
        (("pp", "dp"), "pp+fsdp", {"schedule": "interleaved", "microbatches": 2}),
        (("pp", "dp"), "pp+ddp", {"schedule": "zero-bubble", "microbatches": 2}),
    ]:
        errors = rank_pools.get(4).run(
            "tests.dist.cases_pipeline:pipelined_verify", shape=(2, 2), names=names, plan=plan, pp=pp
        )
        assert errors == ["", "", "", ""], (plan, pp, errors)


def test_verify_names_the_first_value_a_pipeline_stage_computes_differently(rank_pools: RankPools) -> None:
    """A shard of the last layer's down projection perturbed on rank 3 (stage 1): every rank raises the
    same error, naming the first value computed from it."""
    errors = rank_pools.get(4).run(
        "tests.dist.cases_pipeline:pipelined_verify",
        shape=(2, 2),
        names=("pp", "tp"),
        plan="pp+tp",
        pp={"schedule": "1f1b", "microbatches": 2},
        corrupt="layers.3.mlp.down_proj.weight",
    )
    assert len(set(errors)) == 1 and errors[0].startswith("forward: the first value that differs"), errors
    assert "at layers.3.mlp.down_proj (fwd" in errors[0], errors[0]
