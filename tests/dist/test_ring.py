"""Ring attention (``backends/context_parallel/ring_attention.py``): the zigzag layout's blocks and balance, and
the ring on
gloo ranks against one device's attention, forward and backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshfold.backends.context_parallel.ring_attention import ring_blocks, sequence_shard, sequence_unshard
from tests.dist.conftest import RankPools


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_blocks_cover_the_causal_square_once_and_balance_the_ranks(cp: int) -> None:
    """Under a causal mask the blocks of all ranks over all steps are each (query chunk, key chunk)
    pair at or below the diagonal once, the diagonal ones causal; and every rank computes the same
    area (a diagonal block counts half)."""
    seen: dict[tuple[int, int], bool] = {}
    areas = []
    for rank in range(cp):
        area = 0.0
        for s, step in enumerate(ring_blocks(rank, cp, causal=True)):
            src = (rank - s) % cp
            for b in step:
                a = (rank, 2 * cp - 1 - rank)[b.query]
                k = (src, 2 * cp - 1 - src)[b.key]
                assert (a, k) not in seen
                seen[(a, k)] = b.causal
                area += 0.5 if b.causal else 1.0
        areas.append(area)
    assert set(seen) == {(a, k) for a in range(2 * cp) for k in range(a + 1)}
    assert all(c == (a == k) for (a, k), c in seen.items())
    assert len(set(areas)) == 1, areas


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_sequence_layouts_round_trip(layout: str) -> None:
    x = torch.arange(2 * 3 * 16).reshape(2, 3, 16)
    assert torch.equal(sequence_unshard([sequence_shard(x, 2, 4, r, layout) for r in range(4)], 2, layout), x)


# NOTE: (ranks, causal, ranks per ring, key/value heads of 4 query heads, layout, sliding window); a window of
# 6 over chunks of 4 (contiguous) or 2 (zigzag) leaves blocks it hides whole (skipped) and rows a block hides
# whole (their log-sum-exp must not count)
CASES = [
    (2, True, None, 4, "zigzag", None),
    (4, True, None, 4, "zigzag", None),
    (4, False, None, 4, "zigzag", None),
    (4, True, 2, 4, "zigzag", None),
    (4, True, None, 2, "zigzag", None),
    (4, True, None, 4, "contiguous", None),
    (4, False, None, 2, "contiguous", 6),
    (4, False, None, 4, "zigzag", 6),
]
# NOTE: TokenRing on the same blocks (queries travel instead of keys and values)
TOKENRING = [(2, True, None, 4, "zigzag", None), (4, True, None, 2, "zigzag", None), (4, False, 2, 4, "contiguous", 6)]


def _ids(cases: list[tuple[int, bool, int | None, int, str, int | None]], method: str) -> list[str]:
    return [
        f"{method}-{w}ranks-{'causal' if c else 'full'}-cp{g or w}-kv{h}-{lay}" + (f"-window{win}" if win else "")
        for w, c, g, h, lay, win in cases
    ]


@pytest.mark.parametrize(
    ("method", "case"),
    [("ring", c) for c in CASES] + [("tokenring", c) for c in TOKENRING],
    ids=_ids(CASES, "ring") + _ids(TOKENRING, "tokenring"),
)
def test_ring_attention_equals_attention(
    rank_pools: RankPools, method: str, case: tuple[int, bool, int | None, int, str, int | None]
) -> None:
    """The output, its log-sum-exp and the query, key and value gradients equal one device's attention (float64),
    grouped-query keys and values and a sliding-window mask included; for ring attention and TokenRing."""
    world, causal, group, kv_heads, layout, window = case
    results = rank_pools.get(world).run(
        "tests.dist.cases_ring:ring_equals_attention",
        batch=2,
        heads=4,
        seq=32,
        dim=8,
        causal=causal,
        group_size=group,
        kv_heads=kv_heads,
        layout=layout,
        window=window,
        method=method,
    )
    for rank, errs in enumerate(results):
        assert max(v for k, v in errs.items() if k not in ("sent", "whole", "route", "rank")) < 1e-10, (rank, errs)


@pytest.mark.parametrize(("window", "hops"), [(6, (1, 1, 1, 0)), (12, (2, 2, 1, 0))])
def test_routed_ring_attention_equals_attention(rank_pools: RankPools, window: int, hops: tuple[int, ...]) -> None:
    """Under a sliding window over the contiguous layout (4 ranks, parts of 8) ring attention sends each
    block's columns the next ranks see only as far as they are seen (one step for a window of 6, two for
    12 but from the third rank, whose keys only the last one sees; the gradients of the last rank reached
    go straight home) and still equals one device's attention, output, log-sum-exp and gradients."""
    results = _routed(rank_pools, window, "ring")
    for errs in results:
        assert errs["route"].hops == hops, errs["route"]
    # NOTE: keys and values forward, again backward with their gradients: three times each span, each hop
    route, whole = results[0]["route"], results[0]["whole"]
    per_column = whole // (3 * 3 * 8)
    want = 3 * per_column * sum((end - start) * h for (start, end), h in zip(route.spans, route.hops, strict=True))
    assert sum(r["sent"] for r in results) == want < 0.6 * 4 * whole, (want, whole)


@pytest.mark.parametrize("window", [6, 12])
def test_routed_tokenring_equals_attention(rank_pools: RankPools, window: int) -> None:
    """TokenRing on the same routes sends a rank's query rows (with what travels with them) only to the
    ranks whose keys they see, and only the rows that see them (the first 5 of each part to the rank
    before under a window of 6; under 12, all 8 to the rank before and the first 3 to the one before
    that), the results coming back likewise; it still equals one device's attention."""
    results = _routed(rank_pools, window, "tokenring")
    route, whole = results[0]["route"], results[0]["whole"]
    rows = sum(b - a for r, spans in enumerate(route.queries) for j, (a, b) in enumerate(spans) if j != r)
    assert rows == {6: 3 * 5, 12: 3 * 8 + 2 * 3}[window], route.queries
    # NOTE: whole: every rank's 8 rows to each of 3 peers, out and back, forward and backward
    assert sum(r["sent"] for r in results) == rows * whole // (3 * 8), (rows, whole)


def _routed(rank_pools: RankPools, window: int, method: str) -> list[dict[str, Any]]:
    results = rank_pools.get(4).run(
        "tests.dist.cases_ring:ring_equals_attention",
        batch=2,
        heads=4,
        seq=32,
        dim=8,
        causal=False,
        kv_heads=2,
        layout="contiguous",
        window=window,
        routed=True,
        method=method,
    )
    for rank, errs in enumerate(results):
        assert max(v for k, v in errs.items() if k not in ("sent", "whole", "route", "rank")) < 1e-10, (rank, errs)
    return results
