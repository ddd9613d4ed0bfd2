"""The multi-rank harness itself: spawning, collectives, meshes, failures, hangs and recovery."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from meshfold.tools.pool import RankFailure, RankPool, RankTimeout
from tests.dist.conftest import RankPools

CASES = "tests.dist.cases_smoke"
WORLDS = [1, 2, 4, 8]


def _live(rank_pools: RankPools, world: int) -> RankPool:
    """The session's pool of ``world`` ranks with its ranks running: a test before may have left it to
    respawn them on its next task, which a test counting spawns must not count."""
    pool = rank_pools.get(world)
    assert pool.run(f"{CASES}:rank_and_world") == [(rank, world) for rank in range(world)]
    return pool


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_knows_its_rank_and_world(rank_pools: RankPools, world: int) -> None:
    assert rank_pools.get(world).run(f"{CASES}:rank_and_world") == [(rank, world) for rank in range(world)]


@pytest.mark.parametrize("world", WORLDS)
def test_functional_collectives(rank_pools: RankPools, world: int) -> None:
    n = 3
    results = rank_pools.get(world).run(f"{CASES}:functional_collectives", n=n)
    inputs = [torch.arange(n * world, dtype=torch.float32) + 100 * rank for rank in range(world)]
    total = torch.stack(inputs).sum(0)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["all_reduce"], total)
        torch.testing.assert_close(got["all_gather"], torch.cat(inputs))
        torch.testing.assert_close(got["reduce_scatter"], total[rank * n : (rank + 1) * n])


def test_2d_mesh_groups_reduce_over_their_dim(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run(f"{CASES}:mesh_2d_sums")
    # NOTE: mesh [[0, 1], [2, 3]]: "dp" groups are the columns {0, 2} {1, 3}, "tp" groups the rows {0, 1} {2, 3}.
    assert results == [
        {"coordinate": (0, 0), "dp": 2.0, "tp": 1.0},
        {"coordinate": (0, 1), "dp": 4.0, "tp": 1.0},
        {"coordinate": (1, 0), "dp": 2.0, "tp": 5.0},
        {"coordinate": (1, 1), "dp": 4.0, "tp": 5.0},
    ]


def test_cached_mesh_is_reused_across_tasks(rank_pools: RankPools) -> None:
    pool = rank_pools.get(4)
    first = pool.run(f"{CASES}:cached_mesh_groups")
    assert pool.run(f"{CASES}:cached_mesh_groups") == first
    assert first[0][1] == first[1][1] != first[2][1] == first[3][1]


def test_kwargs_reach_the_task_but_timeout_does_not(rank_pools: RankPools) -> None:
    got = rank_pools.get(2).run(f"{CASES}:echo", timeout=30, target="t", values=[1, 2])
    assert got == [{"target": "t", "values": [1, 2]}] * 2


def test_rank_output_is_relayed(rank_pools: RankPools, capsys: pytest.CaptureFixture[str]) -> None:
    assert rank_pools.get(2).run(f"{CASES}:print_and_return", text="hello") == [0, 1]
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out
    assert "[rank 1] hello from 1" in out


def test_failure_on_one_rank_reports_its_traceback_and_keeps_the_pool(rank_pools: RankPools) -> None:
    pool = _live(rank_pools, 4)
    spawns = pool.spawns
    with pytest.raises(RankFailure) as info:
        pool.run(f"{CASES}:raise_on", rank=1)
    assert not isinstance(info.value, RankTimeout)
    assert list(info.value.failures) == [1]
    message = str(info.value)
    assert "--- rank 1 failed ---" in message
    assert "Traceback (most recent call last)" in message
    assert 'raise ValueError(f"deliberate failure on rank {rank}")' in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert pool.run(f"{CASES}:rank_and_world") == [(rank, 4) for rank in range(4)]
    assert pool.spawns == spawns


def test_a_failure_after_a_point_to_point_task_keeps_the_pool(rank_pools: RankPools) -> None:
    """A send and its receive leave the two ranks' sequence counts ahead of the others' for good; a
    later failure on one rank before any collective finds the ranks alike within that task and keeps
    them (compared since the start, their counts would disagree, and the pool respawned them)."""
    pool = _live(rank_pools, 4)
    spawns = pool.spawns
    assert pool.run(f"{CASES}:send_to_next") == [0, 0, 2, 3]
    with pytest.raises(RankFailure, match="deliberate failure on rank 2") as info:
        pool.run(f"{CASES}:raise_on", rank=2)
    assert "disagree" not in str(info.value) and "respawns" not in str(info.value)
    assert pool.run(f"{CASES}:rank_and_world") == [(rank, 4) for rank in range(4)]
    assert pool.spawns == spawns


def test_unknown_target_and_unpicklable_result_keep_the_pool(rank_pools: RankPools) -> None:
    pool = _live(rank_pools, 2)
    spawns = pool.spawns
    with pytest.raises(RankFailure, match="ModuleNotFoundError"):
        pool.run("tests.dist.no_such_module:case")
    with pytest.raises(RankFailure, match="AttributeError"):
        pool.run(f"{CASES}:no_such_case")
    with pytest.raises(RankFailure, match="unpicklable value"):
        pool.run(f"{CASES}:unpicklable_result")
    assert pool.run(f"{CASES}:rank_and_world") == [(0, 2), (1, 2)]
    assert pool.spawns == spawns


def test_bad_arguments_fail_in_the_parent(rank_pools: RankPools) -> None:
    pool = rank_pools.get(1)
    with pytest.raises(ValueError, match=r"package\.module:function"):
        pool.run("tests.dist.cases_smoke.rank_and_world")
    with pytest.raises((TypeError, pickle.PicklingError)):
        pool.run(f"{CASES}:echo", lock=threading.Lock())
    assert pool.run(f"{CASES}:rank_and_world") == [(0, 1)]


def test_hang_times_out_and_the_pool_recovers(rank_pools: RankPools) -> None:
    pool = _live(rank_pools, 2)
    spawns = pool.spawns
    with pytest.raises(RankTimeout) as info:
        pool.run(f"{CASES}:skip_collective", rank=0, timeout=10)
    assert list(info.value.stuck) == [1]
    assert "in skip_collective" in info.value.stuck[1]
    assert pool.run(f"{CASES}:rank_and_world") == [(0, 2), (1, 2)]
    assert pool.spawns == spawns + 1


def test_failure_while_others_wait_in_a_collective_respawns(rank_pools: RankPools) -> None:
    pool = _live(rank_pools, 2)
    spawns = pool.spawns
    with pytest.raises(RankFailure) as info:
        pool.run(f"{CASES}:raise_before_collective", rank=1)
    assert list(info.value.failures) == [1]
    assert list(info.value.stuck) == [0]
    assert "in raise_before_collective" in info.value.stuck[0]
    assert pool.run(f"{CASES}:rank_and_world") == [(0, 2), (1, 2)]
    assert pool.spawns == spawns + 1


def test_dead_rank_respawns(rank_pools: RankPools) -> None:
    pool = _live(rank_pools, 2)
    spawns = pool.spawns
    with pytest.raises(RankFailure, match=r"rank died \(exit code 3\)"):
        pool.run(f"{CASES}:exit_on", rank=1, code=3)
    assert pool.run(f"{CASES}:rank_and_world") == [(0, 2), (1, 2)]
    assert pool.spawns == spawns + 1


def test_a_crashed_rank_is_reported_with_its_python_stack(rank_pools: RankPools) -> None:
    """A rank killed by a fatal signal (here a segmentation fault) leaves no traceback; the failure
    names the signal and holds the stacks faulthandler wrote as it died, and the pool respawns."""
    pool = _live(rank_pools, 2)
    spawns = pool.spawns
    with pytest.raises(RankFailure, match=r"rank died \(exit code -11, SIGSEGV\)") as info:
        pool.run(f"{CASES}:crash_on", rank=1)
    assert list(info.value.failures) == [1]
    assert "Segmentation fault" in info.value.failures[1] and "in crash_on" in info.value.failures[1]
    assert pool.run(f"{CASES}:rank_and_world") == [(0, 2), (1, 2)]
    assert pool.spawns == spawns + 1


def test_diverged_process_group_state_respawns(rank_pools: RankPools) -> None:
    pool = _live(rank_pools, 2)
    spawns = pool.spawns
    with pytest.raises(RankFailure, match="disagree on process-group state"):
        pool.run(f"{CASES}:unfinished_collective_then_raise", rank=1)
    assert pool.run(f"{CASES}:rank_and_world") == [(0, 2), (1, 2)]
    assert pool.spawns == spawns + 1
