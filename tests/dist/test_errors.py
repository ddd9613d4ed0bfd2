"""Bad input to ``parallelize`` fails on every rank with a message naming the problem and the fix,
before any collective runs (the ranks still meet in an all_reduce afterwards)."""

from __future__ import annotations

from tests.dist.conftest import RankPools

EXPECTED = {
    "axis": ["names mesh axis 'pp'", "['dp']"],
    "preset": ["unknown plan preset 'zero3'", "presets: ddp, fsdp, tp, cp"],
    "axis-role": ["mesh axis named 'tp'", "mesh_dim_names"],
    "glob": ["'nothing.*' matches no parameter"],
    "indivisible": ["'lin.weight'", "dim 0 (size 5)", "mesh axis 'dp'", "does not divide"],
    "microbatches": ["input 0 has shape (3, 32)", "2 equal microbatches"],
    "placement": ["unknown placement 'S(x)'"],
    "world": ["the mesh has 1 ranks", "the world has 2"],
    "names": ["no dim names", "mesh_dim_names"],
}


def test_bad_requests_raise_clear_errors_before_any_collective(rank_pools: RankPools) -> None:
    results = rank_pools.get(2).run("tests.dist.cases_errors:bad_requests")
    for rank, messages in enumerate(results):
        assert set(messages) == set(EXPECTED)
        for key, fragments in EXPECTED.items():
            for fragment in fragments:
                assert fragment in messages[key], f"rank {rank}, {key}: {fragment!r} not in {messages[key]!r}"
