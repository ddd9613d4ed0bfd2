"""Fixtures for property tests that execute on ranks: one 4-rank gloo pool for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshfold.tools.pool import RankPool


@pytest.fixture(scope="session")
def chain_pool() -> Iterator[RankPool]:
    """A pool of 4 gloo ranks (the (2, 2) ``("dp", "tp")`` mesh of the chain properties), spawned once."""
    pool = RankPool(4)
    try:
        yield pool
    finally:
        pool.close()
