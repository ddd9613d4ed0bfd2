"""How far each rank's queries reach under an attention mask, and what ring attention makes of it:
which layout balances the work, and which key columns need to travel at all.

Each rank holds its query rows of the mask over every key column (``[*, L/cp, S]``), so it knows,
for every other rank's contiguous block of keys, the first and last column its own queries see,
and how many (query, key) pairs each half of its rows sees. One all-gather of those few numbers
(``measure``, ``2 + 4 * cp`` integers per rank) tells every rank the same ``Reach``:

* the layout: ``"zigzag"`` when moving to it cuts the busiest rank's work by more than a tenth (a
  causal mask over one long sequence: in the contiguous layout the last rank sees every earlier
  key), else ``"contiguous"`` (a batch packed by ``meshfold.packing``, whose parts are balanced
  already; a sliding window);
* in the contiguous layout, per rank's key block, the span of columns some other rank's queries
  see and the farthest such rank round the ring (a ``Route``): only that part of its keys and
  values goes round, only that far (one step under a sliding window), and nothing of a block no
  other rank sees (sequences kept whole on one rank, padding).

Every rank computes the same answer from the same gathered numbers, so they agree on what each
ring step sends and receives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

ZIGZAG_GAIN = 0.9
"""The zigzag layout is taken when its busiest rank does less than this share of the contiguous
layout's busiest rank's work."""


Span = tuple[int, int]
"""The ``(start, end)`` columns of a rank's key block that travel round the ring."""


@dataclass(frozen=True)
class Route:
    """Per rank's key block: the ``spans`` of its columns that travel round the ring, and how many
    ``hops`` they travel (0: none; ``cp - 1``: to every other rank); and what TokenRing sends
    instead: ``queries[r][j]``, the span of rank ``r``'s query rows that see rank ``j``'s keys
    (``None`` where the mask has one row for all: every row)."""

    spans: tuple[Span, ...]
    hops: tuple[int, ...]
    queries: tuple[tuple[Span | None, ...], ...] = ()


@dataclass(frozen=True)
class Reach:
    """What ring attention does with a mask: its ``layout``, and in the contiguous one the ``route``
    of each rank's keys (``None``: whole blocks, to every rank)."""

    layout: str
    route: Route | None = None


def visible(mask: torch.Tensor) -> torch.Tensor:
    """``[L, S]``: which (query row, key column) pairs a boolean or additive mask lets through for
    any batch entry and head. An additive mask hides with ``-inf`` or with its dtype's lowest value
    (HF's eager masks) where ``canonical`` does: a row that hides every key with the lowest value
    weighs them all alike, so it counts as seeing them all."""
    seen = mask if mask.dtype == torch.bool else ~torch.isneginf(canonical(mask))
    return seen.reshape(-1, *seen.shape[-2:]).any(0)


def _first_last(seen: torch.Tensor) -> list[int]:
    """The first and one past the last True of a 1-D ``seen``; ``(len, 0)`` when none is."""
    at = torch.nonzero(seen).flatten()
    return [int(at[0]), int(at[-1]) + 1] if at.numel() else [seen.shape[0], 0]


def canonical(mask: torch.Tensor) -> torch.Tensor:
    """An additive mask that hides with its dtype's lowest value, hiding with ``-inf`` instead wherever
    its row lets some key through: the same weights (``exp`` of the lowest value beside any real
    score is exactly 0), and what the ring kernels skip blocks by. A row hiding every key that way
    keeps it (it weighs all keys alike); boolean masks, and masks without it, are returned as they are."""
    if mask.dtype == torch.bool:
        return mask
    low = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(low.any()):
        return mask
    return mask.masked_fill(low & ~low.all(-1, keepdim=True), -math.inf)


def measure(mask: torch.Tensor, cp: int) -> torch.Tensor:
    """This rank's numbers (see the module doc), from its rows of ``mask``: the pairs seen by each
    half of its rows; per key block ``j`` of ``cp``, the first and one past the last column its rows
    see in it; and per key block, the first and one past the last of its rows that see into it
    (``(n, 0)`` when none; ``(0, -1)`` for a mask of one row for all)."""
    seen = visible(mask)
    rows = seen.expand(2, -1) if seen.shape[0] == 1 else seen  # NOTE: one row broadcast over every query row
    halves = [int(h.sum()) for h in rows.chunk(2, 0)]
    spans: list[int] = []
    for part in seen.any(0).chunk(cp):
        spans += _first_last(part)
    for part in seen.chunk(cp, dim=1):
        spans += [0, -1] if seen.shape[0] == 1 else _first_last(part.any(1))
    return torch.tensor(halves + spans, dtype=torch.int64)


def decide(numbers: torch.Tensor) -> Reach:
    """The ``Reach`` from every rank's ``measure`` (``[cp, 2 + 4 * cp]``, in rank order)."""
    cp = numbers.shape[0]
    halves = numbers[:, :2].flatten().tolist()  # NOTE: half-chunk h of 2 * cp, in sequence order
    contiguous = max(halves[2 * r] + halves[2 * r + 1] for r in range(cp))
    zigzag = max(halves[r] + halves[2 * cp - 1 - r] for r in range(cp))
    if zigzag < ZIGZAG_GAIN * contiguous:
        return Reach("zigzag")
    spans, hops = [], []
    for j in range(cp):
        sees = [r for r in range(cp) if r != j and numbers[r, 3 + 2 * j] > numbers[r, 2 + 2 * j]]
        start = min((int(numbers[r, 2 + 2 * j]) for r in sees), default=0)
        end = max((int(numbers[r, 3 + 2 * j]) for r in sees), default=0)
        spans.append((start, end) if sees else (0, 0))
        hops.append(max(((r - j) % cp for r in sees), default=0))
    queries = []
    for r in range(cp):
        row = numbers[r, 2 + 2 * cp :].tolist()
        pairs = [(row[2 * j], row[2 * j + 1]) for j in range(cp)]
        queries.append(tuple(None if end < 0 else (a, end) if end > a else (0, 0) for a, end in pairs))
    return Reach("contiguous", Route(tuple(spans), tuple(hops), tuple(queries)))


def reach(mask: torch.Tensor, group: dist.ProcessGroup) -> Reach:
    """The ``Reach`` of this rank's mask rows over ``group`` (one all-gather of a few integers)."""
    cp = dist.get_world_size(group)
    mine = measure(mask, cp)
    every = [torch.empty_like(mine) for _ in range(cp)]
    dist.all_gather(every, mine, group=group)
    return decide(torch.stack(every))
