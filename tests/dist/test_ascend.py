"""The Ascend backend on gloo ranks: each rank's programs lowered to the ATen graphs torchair's graph
mode converts (``backends/ascend.py``). Without an NPU, the lowering's output is checked three ways:
against golden files, op by op against torchair's converter table, and by running the traced graphs
on CPU ranks in place of graph mode, equal to one device. With torch_npu and an NPU (``npu`` mark),
the same programs run in graph mode."""

from __future__ import annotations

import importlib.util

import pytest

from meshfold.backends.ascend import converters
from tests.dist.conftest import RankPools
from tests.golden.harness import GOLDEN_DIR, expect_text

CASES = [("llama-tiny", "fsdp+tp"), ("gpt2-tiny", "ddp+tp")]


def test_ge_graphs_match_golden_files_and_every_op_has_a_converter(rank_pools: RankPools) -> None:
    out = rank_pools.get(4).run("tests.dist.cases_ascend:ge_graphs", model="llama-tiny", plan="fsdp+tp")
    _, known = converters()
    for rank, r in enumerate(out):
        missing = [op for op in r["ops"] if op not in known and op != "<built-in function getitem>"]
        assert not missing, (rank, missing)
        # NOTE: as HCCL runs them: all-gathers and reduce-scatters, no all-to-all standing in for a gather
        assert "_c10d_functional.all_gather_into_tensor.default" in r["ops"], r["ops"]
        assert "_c10d_functional.all_to_all_single.default" not in r["ops"], r["ops"]
        assert not any("scaled_dot_product" in op for op in r["ops"])  # NOTE: CPU attention lowered to GE's ops
    for phase in ("forward", "backward"):
        expect_text(GOLDEN_DIR / "ascend" / f"llama-tiny.fsdp+tp.rank0.{phase}.txt", out[0][phase] + "\n")


@pytest.mark.parametrize(("model", "plan"), CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_ge_graphs_train_as_one_device(rank_pools: RankPools, model: str, plan: str) -> None:
    out = rank_pools.get(4).run("tests.dist.cases_ascend:ge_equivalence", model=model, plan=plan)
    assert all(r["worst_grad_abs_diff"] <= 1e-5 for r in out), [r["worst_grad_abs_diff"] for r in out]


def test_expert_exchange_is_refused_naming_the_op(rank_pools: RankPools) -> None:
    out = rank_pools.get(4).run("tests.dist.cases_ascend:ge_refused", kind="moe")
    assert all(message == out[0] for message in out)
    assert out[0].startswith("backend='ascend' cannot lower meshfold.moe_experts at layers.0."), out[0]
    assert ".py:" in out[0] and "Use backend='eager'" in out[0]


def _npu() -> bool:
    if importlib.util.find_spec("torch_npu") is None or importlib.util.find_spec("torchair") is None:
        return False
    import torch
    import torch_npu  # noqa: F401

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


@pytest.mark.npu
@pytest.mark.skipif(not _npu(), reason="needs torch_npu, torchair and an Ascend NPU")
def test_graph_mode_on_npu_trains_as_one_device() -> None:
    from tests.dist.cases_backends import one_rank_on

    assert one_rank_on("npu", "ascend", "hccl", 29533) <= 1e-3
