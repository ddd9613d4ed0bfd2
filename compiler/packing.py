"""Packed batches of variable-length sequences for a context-parallel group, each sequence given a
context-parallel degree by its length, batch by batch (the idea of ByteScale and FlexSP).

A batch of ``tokens`` tokens is one row ``[1, tokens]`` that a ``cp`` mesh axis of ``ranks`` ranks
splits into ``ranks`` equal contiguous parts. ``pack_sequences`` decides where each token goes:

* a sequence longer than ``split_above`` tokens is split over every rank, in the zigzag order
  (cut in ``2 * ranks`` chunks, rank ``r`` holds chunks ``r`` and ``2 * ranks - 1 - r``, so that under
  the causal mask each rank does the same share of its work): its keys and values must travel
  round the ring;
* every other sequence stays whole on one rank (data parallel within the ``cp`` group): the rank
  with room for it and the least attention work so far, longest sequences first;
* while the busiest rank's attention work exceeds the mean by more than ``balance``, its longest
  whole sequence is split too, and a sequence no rank has room for whole is split;
* each rank's part holds its split chunks first, then its whole sequences, then padding (each
  padding token a sequence of its own, which sees itself only).

Attention reads the batch through ``doc_mask``: a query sees the keys of its own sequence at its
position or before, so the order of the tokens in the row changes nothing but where they are
computed, and a compiled model given the packed row equals one device given the sequences in
order (``pack_sequences(..., ranks=1)``). Ring attention then passes round only the key columns
another rank's queries see (``backends/ring_reach.py``): the split sequences' chunks, at the front
of each part, and nothing of the sequences kept whole.
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
    label (the next token of its sequence, or ``IGNORE``), and each sequence's degree (1: whole on
    one rank, ``ranks``: split over all)."""

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
        """Per rank, the (query, key) pairs its queries see under ``doc_mask``: its attention's work."""
        seen = doc_mask(self.doc_ids, self.position_ids)[0, 0].sum(-1)
        return [int(part.sum()) for part in seen.chunk(self.ranks)]

    def ring_tokens(self) -> list[int]:
        """Per rank, its tokens of split sequences: the key columns other ranks' queries see."""
        split = torch.tensor([d > 1 for d in self.degrees] + [False])
        docs = self.doc_ids[0].clamp(min=-1)  # NOTE: padding indexes the last (False) entry
        return [int(split[part].sum()) for part in docs.chunk(self.ranks)]


def doc_mask(doc_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, T, T]``: whether query ``i`` sees key ``j``: the same sequence, at ``i``'s position
    or before (the causal mask of each sequence, whatever order the tokens are in)."""
    same = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    before = position_ids.unsqueeze(-2) <= position_ids.unsqueeze(-1)
    return (same & before).unsqueeze(1)


def _chunks(length: int, n: int, turn: int) -> list[tuple[int, int]]:
    """``length`` cut in ``n`` nearly equal ``(start, end)`` chunks, the longer ones starting at
    chunk ``turn`` (so successive sequences round up on different ranks)."""
    base, extra = divmod(length, n)
    sizes = [base + ((k - turn) % n < extra) for k in range(n)]
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return list(itertools.pairwise(bounds))


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
    ``split_above``: the length above which a sequence is split over every rank (default half a
    rank's part; 0 splits every sequence: one fixed degree); ``balance``: how far above the mean the
    busiest rank's attention work may be before more sequences are split. Raises ``ValueError``
    when the sequences do not fit in ``tokens``."""
    if ranks < 1 or tokens % ranks:
        raise ValueError(f"pack_sequences: {tokens} tokens do not split into {ranks} equal parts")
    room = tokens // ranks
    if sum(len(s) for s in sequences) > tokens:
        raise ValueError(
            f"pack_sequences: {sum(len(s) for s in sequences)} tokens of sequences do not fit in {tokens}; "
            "pack fewer sequences or raise tokens"
        )
    limit = room // 2 if split_above is None else split_above
    split = {i for i, s in enumerate(sequences) if ranks > 1 and len(s) > limit}
    while True:
        parts, work, left = _place(sequences, split, ranks, room)
        if left is not None:
            split.add(left)  # NOTE: it fits no rank whole: split it too, and place the rest again
            continue
        busiest = max(range(ranks), key=lambda r: work[r])
        whole = [i for i, _, _ in parts[busiest] if i not in split]
        if not whole or work[busiest] <= (1 + balance) * sum(work) / ranks:
            break
        split.add(max(whole, key=lambda i: len(sequences[i])))
    filled = [sum(e - b for _, b, e in part) for part in parts]
    if max(filled) > room:
        raise ValueError(
            f"pack_sequences: splitting {len(split)} sequences over {ranks} ranks leaves a part of {max(filled)} "
            f"tokens, above its {room}; raise tokens"
        )
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
    degrees = tuple(ranks if i in split else 1 for i in range(len(sequences)))
    return PackedBatch(*row, degrees=degrees, ranks=ranks)


def _place(
    sequences: Sequence[torch.Tensor], split: set[int], ranks: int, room: int
) -> tuple[list[list[tuple[int, int, int]]], list[int], int | None]:
    """Each rank's ``(sequence, start, end)`` pieces: the ``split`` sequences' zigzag chunks, then the
    others whole, longest first, each on the rank with room and the least work; each rank's work;
    and the first sequence no rank has room for (not placed), if any."""
    parts: list[list[tuple[int, int, int]]] = [[] for _ in range(ranks)]
    work, filled = [0] * ranks, [0] * ranks
    for turn, i in enumerate(sorted(split)):
        cut = _chunks(len(sequences[i]), 2 * ranks, turn)
        for r in range(ranks):
            for b, e in (cut[r], cut[2 * ranks - 1 - r]):
                if e > b:
                    parts[r].append((i, b, e))
                    work[r] += _work(b, e)
                    filled[r] += e - b
    whole = sorted((i for i in range(len(sequences)) if i not in split), key=lambda i: -len(sequences[i]))
    for i in whole:
        n = len(sequences[i])
        fits = [r for r in range(ranks) if filled[r] + n <= room]
        if not fits:
            return parts, work, i
        r = min(fits, key=lambda r: (work[r], filled[r]))
        if n:
            parts[r].append((i, 0, n))
        work[r] += _work(0, n)
        filled[r] += n
    return parts, work, None
