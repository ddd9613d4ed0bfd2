"""New shapes, modes and no-grad calls get programs of their own, equal to the single-device model;
random ops agree across ranks whatever each rank's seed."""

from __future__ import annotations

from tests.dist.conftest import RankPools


def test_new_shapes_compile_programs_of_their_own(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_programs:new_shapes")
    said = results[0]
    assert all(r == said for r in results), results
    assert said["one rank"].startswith("the ranks called the module with different inputs")
    assert len(said["evicted"]) == 1 and "holds 3 compiled programs" in said["evicted"][0]
    # NOTE: least recently used first: batch 4 went; batch 8, batch 3, batch 2 (1 call each)
    assert [calls for _, calls in said["programs"]] == [1, 1, 1], said["programs"]
    assert said["programs"][0][0] == "(x: f32[8, 32], target: f32[8, 16]) in train mode"
    assert said["llama programs"] == 3
    # NOTE: one symbolic program (sequence length s*) served both new lengths; the batch of mlp stays static
    assert len(said["llama templates"]) == 1, (said["llama templates"], said["llama compiled"])
    ((specialized, dims),) = said["llama templates"]
    assert specialized == 2 and dims[0] == "2" and dims[1].startswith("s"), said["llama templates"]
    assert said["llama compiled"] == 2 and said["mlp templates"] == 0


def test_modes_no_grad_and_per_rank_seeds(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_programs:modes_and_seeds")
    said = results[0]
    assert all(r == said for r in results), results
    assert said["backward collectives without grad"] == [0, 0]
    assert len(said["programs"]) == 4


def test_a_call_under_autocast_gets_a_program_of_its_own(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_programs:autocast_calls")
    said = results[0]
    assert all(r == said for r in results), results
    assert said["autocast changes the loss"] and said["again without autocast"]
    assert sorted(said["programs"]) == [
        "(x: f32[8, 16], y: f32[8, 16]) in train mode",
        "(x: f32[8, 16], y: f32[8, 16]) in train, autocast cpu bf16 mode",
    ]
