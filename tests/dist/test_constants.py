"""Tensor constants made in the forward train like the single-device model."""

from __future__ import annotations

from tests.dist.conftest import RankPools


def test_list_indices_and_slice_assignments_match_single_device(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run("tests.dist.cases_constants:constants")
    assert all(r == results[0] for r in results), results
