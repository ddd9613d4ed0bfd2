"""Packed batches of variable-length sequences for a context-parallel group, each sequence given a
context-parallel degree by its length, batch by batch (the idea of ByteScale and FlexSP).

A batch of ``tokens`` tokens is one row ``[1, tokens]`` that a ``cp`` mesh axis of ``ranks`` ranks
splits into ``ranks`` equal contiguous parts. ``pack_sequences`` decides where each token goes:

* a sequence's degree is the smallest power of two ``d`` (dividing ``ranks``, or ``ranks`` itself)
  with ``length <= d * split_above``: the short ones stay whole on one rank (data parallel within
  the ``cp`` group), a longer one is split over an aligned group of ``d`` consecutive ranks in the
  zigzag order (cut in ``2 * d`` chunks, member ``k`` holds chunks ``k`` and ``2 * d - 1 - k``, so that
  under the causal mask each member does the same share of its work);
* widest first, longest first, each sequence goes to the group with room for it and the least
  attention work so far;
* while the busiest rank's attention work exceeds the mean by more than ``balance``, its longest
  sequence not split over every rank is split twice as wide, and so is a sequence no group has
  room for;
* each rank's part holds its split chunks first, then its whole sequences, then padding (each
  padding token a sequence of its own, which sees itself only).

Attention reads the batch through ``doc_mask``: a query sees the keys of its own sequence at its
position or before, so the order of the tokens in the row changes nothing but where they are
computed, and a compiled model given the packed row equals one device given the sequences in
order (``pack_sequences(..., ranks=1)``). Ring attention then passes round only the key columns
another rank's queries see, as far as they are seen, and TokenRing sends only the query rows that
see another rank's keys (``backends/context_parallel/ring_reach.py``): the split sequences' chunks, at the front of
each part, and nothing of the sequences kept whole.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE = -100
"""The label of a token no loss is taken at (a sequence's last token, padding): cross-entropy's default."""


@dataclass(frozen=True)
class PackedBatch:
    """One packed row of ``len(degrees)`` sequences for ``ranks`` ranks: token ids, each token's
    position in its sequence, its sequence's index (padding: negative, each token its own), its
    label (the next token of its sequence, or ``IGNORE``), and each sequence's degree (how many
    ranks hold it: 1, whole on one, up to ``ranks``, split over all)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    labels: torch.Tensor
    degrees: tuple[int, ...]
    ranks: int

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, position_ids, doc_ids, labels)``, as a packed model's forward takes them."""
        return self.input_ids, self.position_ids, self.doc_ids, self.labels

    def attention_work(self) -> list[int]:
        """Per rank, the (query, key) pairs its queries see under ``doc_mask``: its attention's work
        (a token sees its position's worth of keys plus itself; a padding token, itself)."""
        seen = torch.where(self.doc_ids[0] >= 0, self.position_ids[0] + 1, 1)
        return [int(part.sum()) for part in seen.chunk(self.ranks)]

    def ring_tokens(self) -> list[int]:
        """Per rank, its tokens of split sequences (degree above 1): what other ranks' queries see."""
        split = torch.tensor([d > 1 for d in self.degrees] + [False])
        docs = self.doc_ids[0].clamp(min=-1)  # NOTE: padding indexes the last (False) entry
        return [int(split[part].sum()) for part in docs.chunk(self.ranks)]


def doc_mask(doc_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, T, T]``: whether query ``i`` sees key ``j``: the same sequence, at ``i``'s position
    or before (the causal mask of each sequence, whatever order the tokens are in)."""
    same = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    before = position_ids.unsqueeze(-2) <= position_ids.unsqueeze(-1)
    return (same & before).unsqueeze(1)


def _pieces(length: int, fill: list[int]) -> list[tuple[tuple[int, int], ...]]:
    """A sequence of ``length`` over a group whose members hold ``fill`` tokens so far: member ``k`` of
    ``d`` gets chunks ``k`` and ``2d - 1 - k`` of ``2d`` nearly equal ``(start, end)`` chunks (the whole
    sequence when ``d == 1``), the longer chunks going to the members that hold least."""
    d = len(fill)
    if d == 1:
        return [((0, length),)]
    base, extra = divmod(length, 2 * d)
    chunks = [c for k in sorted(range(d), key=lambda k: (fill[k], k)) for c in (k, 2 * d - 1 - k)]
    longer = set(chunks[:extra])
    bounds = list(itertools.accumulate((base + (c in longer) for c in range(2 * d)), initial=0))
    return [((bounds[k], bounds[k + 1]), (bounds[2 * d - 1 - k], bounds[2 * d - k])) for k in range(d)]


def _work(start: int, end: int) -> int:
    """The causal (query, key) pairs of positions ``start .. end - 1`` of one sequence."""
    return (end * (end + 1) - start * (start + 1)) // 2


def pack_sequences(
    sequences: Sequence[torch.Tensor],
    *,
    ranks: int,
    tokens: int,
    split_above: int | None = None,
    balance: float = 0.2,
    pad_id: int = 0,
) -> PackedBatch:
    """Pack 1-D token sequences into one row of ``tokens`` for ``ranks`` ranks (see the module doc).
    ``split_above``: the most tokens a sequence may put on each rank of its group before its degree
    doubles (default half a rank's part; 0 splits every sequence over every rank: one fixed
    degree); ``balance``: how far above the mean the busiest rank's attention work may be before
    sequences are split wider. Raises ``ValueError`` when the sequences do not fit in ``tokens``."""
    if ranks < 1 or tokens % ranks:
        raise ValueError(f"pack_sequences: {tokens} tokens do not split into {ranks} equal parts")
    room = tokens // ranks
    if sum(len(s) for s in sequences) > tokens:
        raise ValueError(
            f"pack_sequences: {sum(len(s) for s in sequences)} tokens of sequences do not fit in {tokens}; "
            "pack fewer sequences or raise tokens"
        )
    limit = room // 2 if split_above is None else split_above
    allowed = _degrees(ranks)
    degree = [next((d for d in allowed if len(s) <= d * limit), ranks) for s in sequences]
    while True:
        parts, work, left = _place(sequences, degree, ranks, room)
        if left is not None:  # NOTE: it fits no group whole: split it wider, and place the rest again
            if degree[left] == ranks:
                raise ValueError(
                    f"pack_sequences: sequence {left} ({len(sequences[left])} tokens) split over all {ranks} ranks "
                    f"finds no room beside the others in parts of {room}; raise tokens"
                )
            degree[left] = allowed[allowed.index(degree[left]) + 1]
            continue
        busiest = max(range(ranks), key=lambda r: work[r])
        wider = [i for i, _, _ in parts[busiest] if degree[i] < ranks]
        if not wider or work[busiest] <= (1 + balance) * sum(work) / ranks:
            break
        i = max(wider, key=lambda i: len(sequences[i]))
        degree[i] = allowed[allowed.index(degree[i]) + 1]
    filled = [sum(e - b for _, b, e in part) for part in parts]
    ids, pos, docs, labels = [], [], [], []
    for r, part in enumerate(parts):
        for i, b, e in part:
            seq = sequences[i].long()
            ids.append(seq[b:e])
            pos.append(torch.arange(b, e))
            docs.append(torch.full((e - b,), i))
            labels.append(torch.cat([seq[1:], torch.tensor([IGNORE])])[b:e])
        pad = room - filled[r]
        ids.append(torch.full((pad,), pad_id))
        pos.append(torch.arange(pad))
        docs.append(-1 - torch.arange(r * room + filled[r], (r + 1) * room))
        labels.append(torch.full((pad,), IGNORE))
    row = [torch.cat(x).unsqueeze(0) for x in (ids, pos, docs, labels)]
    return PackedBatch(*row, degrees=tuple(degree), ranks=ranks)


def _degrees(ranks: int) -> list[int]:
    """The degrees a sequence may have on ``ranks``: the powers of two that divide it, and ``ranks``."""
    return sorted({d for d in (2**k for k in range(ranks.bit_length())) if ranks % d == 0} | {ranks})


def _place(
    sequences: Sequence[torch.Tensor], degree: list[int], ranks: int, room: int
) -> tuple[list[list[tuple[int, int, int]]], list[int], int | None]:
    """Each rank's ``(sequence, start, end)`` pieces: widest degree first, longest first, each sequence
    on the group of ``degree`` consecutive ranks (aligned) with room for it and the least work, in
    zigzag chunks over the group (whole on one rank at degree 1); each rank's work; and the first
    sequence no group has room for (not placed), if any."""
    parts: list[list[tuple[int, int, int]]] = [[] for _ in range(ranks)]
    work, filled = [0] * ranks, [0] * ranks
    order = sorted(range(len(sequences)), key=lambda i: (-degree[i], -len(sequences[i]), i))
    for i in order:
        d, n = degree[i], len(sequences[i])
        fits = []
        for g in range(0, ranks, d):
            grp = range(g, g + d)
            pieces = _pieces(n, [filled[r] for r in grp])
            if all(filled[r] + sum(e - b for b, e in p) <= room for r, p in zip(grp, pieces, strict=True)):
                fits.append((max(work[r] for r in grp), max(filled[r] for r in grp), g, pieces))
        if not fits:
            return parts, work, i
        _, _, g, pieces = min(fits)
        for r, p in zip(range(g, g + d), pieces, strict=True):
            for b, e in p:
                if e > b:
                    parts[r].append((i, b, e))
                    work[r] += _work(b, e)
                    filled[r] += e - b
    return parts, work, None
