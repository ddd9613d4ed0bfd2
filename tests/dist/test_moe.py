"""Expert parallelism folded over the ranks attention uses: loss, every gradient and the parameters
after AdamW steps equal single device (fp32), and each rank holds and computes only its experts."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist.conftest import RankPools

# (model, mesh shape, axis names, plan, moe, the axes the experts are split over)
CASES: list[tuple[str, tuple[int, ...], tuple[str, ...], str, dict[str, Any], tuple[str, ...]]] = [
    # EP=4 folded over all four ranks: attention is fsdp over dp and tp over tp
    ("hf-mixtral", (2, 2), ("dp", "tp"), "fsdp+tp", {"ep": 4, "etp": 1}, ("dp", "tp")),
    # EP=2 on the inner axis, EDP=2 on the outer one
    ("hf-mixtral", (2, 2), ("dp", "tp"), "ddp+tp", {"ep": 2}, ("tp",)),
    # 8 ranks: EP=4 over tp, EDP=2 over dp
    ("hf-mixtral", (2, 4), ("dp", "tp"), "fsdp+tp", {"ep": 4}, ("tp",)),
]


def _id(c: tuple[Any, ...]) -> str:
    return f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[3]}-ep{c[4]['ep']}"


@pytest.mark.hf
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_folded_experts_equal_single_device(rank_pools: RankPools, case: tuple[Any, ...]) -> None:
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
    # NOTE: hf-mixtral: 2 layers x 4 experts x (2*96*64 + 64*96) weights; each rank keeps 1/ep of them
    # (whole on the EDP axes)
    total = 2 * 4 * (2 * 96 * 64 + 64 * 96)
    assert all(r["expert_numel_local"] <= total // moe["ep"] for r in results), [
        r["expert_numel_local"] for r in results
    ]
