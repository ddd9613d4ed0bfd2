"""The Inductor backend on gloo ranks: each rank's forward and backward programs compiled to C++
kernels (``backends/inductor.py``) train zoo models, an HF model and an MoE model with experts split
over 4 ranks (EP) exactly as one device does, and what Inductor cannot compile is refused before
anything runs, naming the op."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.conftest import RankPools

# NOTE: one Llama under fsdp+tp, HF's: the zoo's llama-tiny lowers to the same kinds of ops
CORE: list[tuple[str, str, dict[str, Any] | None]] = [
    ("gpt2-tiny", "ddp+tp", None),
    ("hf-llama", "fsdp+tp", None),
    ("mixtral-tiny", "fsdp+tp", {"ep": 4}),
]


@pytest.mark.parametrize("case", CORE, ids=[f"{m}-{p}{'-ep' if moe else ''}" for m, p, moe in CORE])
def test_inductor_programs_train_as_one_device(rank_pools: RankPools, case: tuple[str, str, Any]) -> None:
    """Each rank's forward and backward compiled by Inductor train as one device does. On the Llama
    the compiled code also keeps the collectives where the overlap pass put them: per collective,
    the matrix products in flight beside it are the same in the code Inductor generated as in the
    eager program (Inductor's default reorderings would pull the waits up)."""
    model, plan, moe = case
    windows = model == "hf-llama"
    out = rank_pools.get(4).run(
        "tests.dist.cases:equivalence",
        model=model,
        shape=(2, 2),
        names=("dp", "tp"),
        plan=plan,
        moe=moe,
        backend="inductor",
        windows=windows,
    )
    assert all(r["worst_grad_abs_diff"] <= 1e-5 for r in out)
    # NOTE: both programs of every rank were compiled by Inductor, then ran once per step
    for rank, r in enumerate(out):
        assert [what.split("'s ")[1] for what, _, _ in r["compiled"]] == ["forward program", "backward program"]
        assert all(seconds > 0 and calls == 2 for _, seconds, calls in r["compiled"]), (rank, r["compiled"])
        if windows:
            assert r["windows"]["inductor"] == r["windows"]["eager"], (rank, r["windows"])
            eager = r["windows"]["eager"]
            assert sum(eager[1]) > 0 and len(eager[0]) > 0, r  # NOTE: there is overlap to keep


def test_what_inductor_cannot_compile_is_refused_naming_the_op(rank_pools: RankPools) -> None:
    out = rank_pools.get(4).run("tests.dist.cases_backends:inductor_refused", kind="offload")
    assert all(message == out[0] for message in out)
    assert out[0].startswith("backend='inductor' cannot compile ") and "copies activations to and from host" in out[0]
    assert "Use backend='eager'" in out[0]
    assert "layers." in out[0] and ".py:" in out[0], out[0]


def test_dropout_under_inductor_draws_the_single_device_masks(rank_pools: RankPools) -> None:
    """Random ops compile as ``meshfold::random_call``, ordered: each draws from meshfold's generator
    in the eager program's order, so every step's dropout masks are the single-device model's
    whatever each rank's own seed, in training, eval and no-grad programs alike."""
    results = rank_pools.get(4).run("tests.dist.cases_programs:modes_and_seeds", backend="inductor")
    said = results[0]
    assert all(r == said for r in results), results
    assert len(said["programs"]) == 4 and len(said["losses"]) == 3


def test_inductor_compiles_a_pipelines_stage_programs(rank_pools: RankPools) -> None:
    """Zero bubble over pp=2 x dp=2: each stage's forward, input-gradient and weight-gradient
    programs compiled by Inductor train as one device does."""
    out = rank_pools.get(4).run(
        "tests.dist.cases_pipeline:pipelined_equivalence",
        shape=(2, 2),
        names=("pp", "dp"),
        plan="pp+fsdp",
        pp={"schedule": "zero-bubble", "microbatches": 4},
        layers=4,
        backend="inductor",
    )
    assert all(r["losses"] == out[0]["losses"] for r in out)
    assert all(r["runs"] == ["Compiled"] for r in out), [r["runs"] for r in out]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_on_cuda_trains_as_one_device() -> None:
    """On CUDA the same backend generates Triton kernels (one rank, NCCL)."""
    from tests.dist.cases_backends import one_rank_on

    assert one_rank_on("cuda", "inductor", "nccl", 29534) <= 1e-3
