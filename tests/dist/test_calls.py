"""A call no program can run raises on every rank alike."""

from __future__ import annotations

from tests.dist.conftest import RankPools


def test_calls_no_program_can_run_are_refused_on_every_rank_alike(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_calls:mismatched_calls")
    assert all(r == results[0] for r in results), results
    said = results[0]
    assert said["one rank"].startswith(
        "the ranks called the module with different inputs (rank 0: (input_ids: i64[2, 16]"
    )
    assert "rank 3: (input_ids: i64[1, 16]" in said["one rank"]
    assert said["bf16"].startswith("input 'x' is bf16; the program was compiled for f32")
    assert "no program can be compiled for this call" in said["bf16"]
    assert "in eval mode" in said["decorated programs"]
    assert said["input grad"].startswith("rank 0: input 'x' requires grad; a compiled module computes gradients")
