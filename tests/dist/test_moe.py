"""Expert parallelism folded over the ranks attention uses: loss, every gradient and the parameters
after AdamW steps equal single device (fp32), and each rank holds and computes only its experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from meshfold import ir
from meshfold.tools.demo import auto_ep
from tests.dist.conftest import RankPools

Case = tuple[str, tuple[int, ...], tuple[str, ...], str, dict[str, Any], tuple[str, ...]]

# (model, mesh shape, axis names, plan, moe, the axes the experts are split over)
CASES: list[Case] = [
    # mixtral-tiny's 4 stacked experts, EP=4 over all four ranks; attention fsdp over dp, tp over tp
    ("mixtral-tiny", (2, 2), ("dp", "tp"), "fsdp+tp", {"ep": 4}, ("dp", "tp")),
    # deepseek-tiny: 8 routed experts (2 per rank) beside a shared expert and a dense first layer
    ("deepseek-tiny", (2, 2), ("dp", "tp"), "ddp+tp", {"ep": 4}, ("dp", "tp")),
    # 8 ranks: EP=4 over tp, EDP=2 over dp
    ("deepseek-tiny", (2, 4), ("dp", "tp"), "fsdp+tp", {"ep": 4}, ("tp",)),
    # experts in an nn.ModuleList run by the data-dependent torch.where / index_add_ loop, folded
    ("moe-loop-tiny", (2, 2), ("dp", "tp"), "fsdp+tp", {"ep": 4}, ("dp", "tp")),
    ("moe-loop-tiny", (2, 4), ("dp", "tp"), "fsdp+tp", {"ep": 4}, ("tp",)),
    # the dense form (every expert on every token, weighted stack), EP=2 with EDP=2
    ("mixtral-list-tiny", (2, 2), ("dp", "tp"), "ddp+tp", {"ep": 2}, ("tp",)),
    # EP=2 over dp x ETP=2 over tp: stacked as [E, 2, I, H], both expert weights split four ways
    ("moe-loop-tiny", (2, 2), ("dp", "tp"), "fsdp+tp", {"ep": 2, "etp": 2}, ("dp",)),
]
HF_CASES: list[Case] = [
    # EP=4 folded over all four ranks: attention is fsdp over dp and tp over tp
    ("hf-mixtral", (2, 2), ("dp", "tp"), "fsdp+tp", {"ep": 4, "etp": 1}, ("dp", "tp")),
    # EP=2 on the inner axis, EDP=2 on the outer one
    ("hf-mixtral", (2, 2), ("dp", "tp"), "ddp+tp", {"ep": 2}, ("tp",)),
    # 8 ranks: EP=4 over tp, EDP=2 over dp
    ("hf-mixtral", (2, 4), ("dp", "tp"), "fsdp+tp", {"ep": 4}, ("tp",)),
]


def _id(c: Case) -> str:
    etp = f"-etp{c[4]['etp']}" if "etp" in c[4] else ""
    return f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[3]}-ep{c[4]['ep']}{etp}"


def _check_folded(rank_pools: RankPools, case: Case) -> None:
    """Run ``case`` on its ranks: equal to single device (checked on the ranks), expert weights split
    over the EP axes in every expert op, and each rank storing at most 1/ep of them."""
    model, shape, names, plan, moe, ep_axes = case
    world = 1
    for s in shape:
        world *= s
    results = rank_pools.get(world).run(
        "tests.dist.cases_moe:folded", model=model, shape=shape, names=names, plan=plan, moe=moe
    )
    first = results[0]
    assert first["expert_ops"], "no meshfold.moe_experts op in the compiled graph"
    for layout in first["expert_ops"]:
        for axis in ep_axes:
            assert f"{axis}: S(0)" in layout, f"experts not split over {axis}: {first['expert_ops']}"
    # NOTE: whole on the EDP axes, so each rank keeps 1/ep of every layer's experts (1/(ep*etp) when
    # ETP splits both weights)
    total = first["expert_numel_total"]
    share = moe["ep"] * (moe.get("etp", 1) if first["etp_splits_gate_up"] else 1)
    assert all(r["expert_numel_total"] == total for r in results)
    assert all(0 < r["expert_numel_local"] <= total // share for r in results), [
        r["expert_numel_local"] for r in results
    ]


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_folded_experts_equal_single_device(rank_pools: RankPools, case: Case) -> None:
    _check_folded(rank_pools, case)


@pytest.mark.hf
@pytest.mark.parametrize("case", HF_CASES, ids=[_id(c) for c in HF_CASES])
def test_folded_hf_experts_equal_single_device(rank_pools: RankPools, case: Case) -> None:
    _check_folded(rank_pools, case)


@pytest.mark.parametrize(
    ("mesh", "experts", "ep"),
    [("dp=2,tp=2", [4, 4], 4), ("dp=2,tp=2", [8], 4), ("dp=2,tp=4", [8], 8), ("dp=2,tp=4", [4], 4), ("dp=2", [3], 1)],
)
def test_demo_splits_experts_over_the_most_ranks_that_divide_them(mesh: str, experts: list[int], ep: int) -> None:
    assert auto_ep(ir.Mesh.parse(mesh), experts) == ep


@pytest.mark.slow
def test_demo_trains_mixtral_tiny_with_experts_folded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from meshfold.tools.cli import main

    assert main(["demo", "--model", "mixtral-tiny", "--steps", "2", "--dump-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "attention: fsdp over dp, tp over tp; experts: EP=4 over (dp, tp), EDP=1" in out
    assert "matches single-device training" in out
    assert "meshfold.moe_experts" in (tmp_path / "parallel.txt").read_text()
