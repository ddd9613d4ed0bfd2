"""Fixtures for multi-rank tests: one lazily spawned ``RankPool`` per world size for the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshfold.tools.pool import PRELOAD, RankPool

DIST_DIR = Path(__file__).resolve().parent


class RankPools:
    """One ``RankPool`` per world size, created on first use and kept until ``close``."""

    def __init__(self, **pool_kwargs: Any) -> None:
        self._pool_kwargs = {"preload": (*PRELOAD, "tests.dist.cases")} | pool_kwargs
        self._pools: dict[int, RankPool] = {}

    def get(self, world: int) -> RankPool:
        """The pool of ``world`` ranks (1, 2, 4 or 8 in practice), spawning it the first time."""
        if world not in self._pools:
            self._pools[world] = RankPool(world, **self._pool_kwargs)
        return self._pools[world]

    def close(self) -> None:
        """Close every pool created so far."""
        while self._pools:
            self._pools.popitem()[1].close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/dist with ``dist`` (select or skip them with ``-m``)."""
    for item in items:
        if item.path.resolve().is_relative_to(DIST_DIR):
            item.add_marker(pytest.mark.dist)


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[RankPools]:
    """``rank_pools.get(world)``: the session's pool of ``world`` gloo ranks, spawned on first use."""
    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()
