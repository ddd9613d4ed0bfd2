"""Comm ops lowered on 4 gloo ranks (``backends/collectives.py``): results and buffers."""

from __future__ import annotations

import pytest

from tests.dist.conftest import RankPools

# NOTE: (shape, concat_dim, split_dim): the batch to the hidden dim and back, a middle dim, one dim
# gathered and cut again
A2A = [((64, 24, 32), 0, 2), ((64, 24, 32), 2, 0), ((64, 24, 32), 0, 1), ((64, 24, 32), 1, 2), ((64, 48), 0, 0)]


@pytest.mark.parametrize(("shape", "concat", "split"), A2A, ids=[f"{c}to{s}-{len(sh)}d" for sh, c, s in A2A])
def test_all_to_all_moves_each_block_to_its_rank(
    rank_pools: RankPools, shape: tuple[int, ...], concat: int, split: int
) -> None:
    """An all-to-all from ``S(concat)`` to ``S(split)``: each rank ends with exactly its ``S(split)``
    slice (contiguous), and the allocator's peak while it runs (``tools.measure.settled_peak_new_bytes``) is the
    estimate's (``rank_memory``, which prices the program's operand too) within 1%."""
    results = rank_pools.get(4).run("tests.dist.cases_comm:all_to_all", shape=shape, concat=concat, split=split)
    for rank, r in enumerate(results):
        assert r["equal"] and r["contiguous"], (rank, r)
        assert abs(r["estimated"] - r["measured"]) <= 0.01 * r["measured"], (rank, r)


# NOTE: (shape, dim, order) on 4 ranks: the ring's shift; the zigzag split of 8 half-chunks
# (ir.dialects.ring.zigzag_order(4)) and its inverse; pieces staying home beside pieces swapped, along dim 0
MOVES = [
    ((2, 3, 16, 4), 2, (3, 0, 1, 2)),
    ((2, 3, 16, 4), 2, (0, 7, 6, 1, 2, 5, 4, 3)),
    ((2, 3, 16, 4), 2, (0, 3, 4, 7, 6, 5, 2, 1)),
    ((8, 5), 0, (1, 0, 2, 3)),
]


@pytest.mark.parametrize(("shape", "dim", "order"), MOVES, ids=["shift", "zigzag", "unzigzag", "swap-dim0"])
def test_ppermute_moves_each_piece_to_its_slot(
    rank_pools: RankPools, shape: tuple[int, ...], dim: int, order: tuple[int, ...]
) -> None:
    """``comm.ppermute``: each rank ends with exactly the pieces its slots take (``order``), contiguous."""
    results = rank_pools.get(4).run("tests.dist.cases_comm:ppermute", shape=shape, dim=dim, order=order)
    for rank, r in enumerate(results):
        assert r["equal"] and r["contiguous"], (rank, r)
