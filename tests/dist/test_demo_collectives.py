"""``meshfold demo``'s collectives table reports what the rank runs: the same calls and bytes per kind as
``torch.profiler`` records in the same step (all-to-alls of the expert dispatcher included)."""

from __future__ import annotations

from tests.dist.conftest import RankPools


def test_llama_fsdp_tp_table_matches_profiler(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run(
        "tests.dist.cases_collectives:demo_table_matches_profiler",
        model="llama-tiny",
        shape=(2, 2),
        names=("dp", "tp"),
        plan="fsdp+tp",
    )
    for r in results:
        assert {"all_gather", "reduce_scatter"} <= set(r["bytes"]), r
        assert "all_to_all" not in r["bytes"]
        assert {"dp", "tp"} <= set(r["groups"])
    # NOTE: the dense program is the same on every rank: same bytes everywhere
    assert all(r["bytes"] == results[0]["bytes"] for r in results)


def test_mixtral_ep_table_shows_all_to_all(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run(
        "tests.dist.cases_collectives:demo_table_matches_profiler",
        model="mixtral-tiny",
        shape=(2, 2),
        names=("dp", "tp"),
        plan="fsdp+tp",
        moe={"ep": 4},
    )
    for r in results:
        assert r["bytes"].get("all_to_all", 0) > 0, r
        assert "ranks 0,1,2,3" in r["groups"] and "?" not in r["groups"]  # NOTE: EP=4 spans every rank
