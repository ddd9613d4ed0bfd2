"""A call that differs from what the program was compiled for raises on every rank alike."""

from __future__ import annotations

from tests.dist.conftest import RankPools


def test_differing_calls_are_refused_on_every_rank_alike(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_calls:mismatched_calls")
    assert all(r == results[0] for r in results), results
    said = results[0]
    assert "input 'input_ids' has shape [1, 16]; the program was compiled for [2, 16]" in said["batch 1"]
    assert "has shape [2, 32]" in said["longer"]
    assert said["one rank"].startswith("rank 3: input 'input_ids' has shape [1, 16]")
    assert "the module is in eval mode; the program was captured in train mode" in said["eval"]
    assert "input 'x' is bf16; the program was compiled for f32" in said["bf16"]
    assert "the module is in eval mode" in said["decorated eval"]
