"""``meshfold.packing``: variable-length sequences packed in one row for the ranks of a ``cp`` axis,
and ``backends/context_parallel/ring_reach.py``: what ring attention makes of the mask such a row (or any) gives."""

from __future__ import annotations

import pytest
import torch

from meshfold.backends.context_parallel.ring_reach import Reach, Route, canonical, decide, measure
from meshfold.packing import IGNORE, doc_mask, pack_sequences


def _sequences(*lengths: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 256, (n,), generator=g) for n in lengths]


LENGTHS = (40, 3, 9, 2, 12, 5, 7, 4, 6)


@pytest.mark.parametrize("split_above", [None, 0, 8, 3])
def test_every_token_once_with_its_label_and_position(split_above: int | None) -> None:
    seqs = _sequences(*LENGTHS)
    pb = pack_sequences(seqs, ranks=4, tokens=96, split_above=split_above)
    ids, pos, docs, labels = (t[0] for t in pb.inputs())
    assert ids.shape == (96,)
    for i, s in enumerate(seqs):
        at = (docs == i).nonzero().flatten()
        order = pos[at].argsort()
        assert pos[at][order].tolist() == list(range(len(s)))
        assert ids[at][order].tolist() == s.tolist()
        assert labels[at][order].tolist() == [*s[1:].tolist(), IGNORE]
    pad = docs < 0
    assert int(pad.sum()) == 96 - sum(LENGTHS)
    assert (labels[pad] == IGNORE).all()
    # NOTE: each padding token is a sequence of its own, which sees itself only
    assert len(set(docs[pad].tolist())) == int(pad.sum())


def test_degrees_follow_lengths_and_whole_sequences_stay_on_one_rank() -> None:
    seqs = _sequences(*LENGTHS)
    pb = pack_sequences(seqs, ranks=4, tokens=96)  # NOTE: split above half a part of 24: 12 tokens
    assert pb.degrees == (4, 1, 1, 1, 1, 1, 1, 1, 1)
    work = pb.attention_work()
    assert 1.05 < max(work) / (sum(work) / 4) <= 1.2, work
    # NOTE: held to 5% of the mean, the busiest rank's longest whole sequence (the 12) is split as well,
    # over the two ranks of a pair
    even = pack_sequences(seqs, ranks=4, tokens=96, balance=0.05)
    assert even.degrees == (4, 1, 1, 1, 2, 1, 1, 1, 1)
    work = even.attention_work()
    assert max(work) <= 1.05 * sum(work) / 4, work
    assert even.ring_tokens() == [16, 16, 10, 10]
    parts = pb.doc_ids[0].chunk(4)
    for i, d in enumerate(pb.degrees):
        holders = [r for r, part in enumerate(parts) if (part == i).any()]
        assert len(holders) == d
    # NOTE: a split sequence's chunks lead every part, in zigzag order (chunks r and 2 * cp - 1 - r of 8)
    for r, part in enumerate(pb.position_ids[0].chunk(4)):
        assert part[:10].tolist() == [*range(5 * r, 5 * r + 5), *range(35 - 5 * r, 40 - 5 * r)]
    assert pb.ring_tokens() == [10, 10, 10, 10]
    assert set(pack_sequences(seqs, ranks=4, tokens=96, split_above=0).degrees) == {4}


def test_a_sequence_between_gets_a_degree_between() -> None:
    """Degrees are powers of two: a sequence longer than half a part but not than a part is split over
    an aligned pair of ranks, in zigzag chunks within the pair."""
    pb = pack_sequences(_sequences(20, 30, 20, 5, 3), ranks=4, tokens=96)
    assert pb.degrees == (2, 4, 2, 1, 1)
    parts = pb.doc_ids[0].chunk(4)
    pairs = [[r for r, part in enumerate(parts) if (part == i).any()] for i in (0, 2)]
    assert sorted(pairs) == [[0, 1], [2, 3]], pairs
    for i, pair in zip((0, 2), pairs, strict=True):
        first = pb.position_ids[0].chunk(4)[pair[0]][parts[pair[0]] == i]
        assert first.tolist() == [*range(5), *range(15, 20)]  # NOTE: chunks 0 and 3 of 4


def test_a_sequence_no_part_has_room_for_is_split() -> None:
    pb = pack_sequences(_sequences(14, 14, 14), ranks=2, tokens=48, split_above=100)
    assert pb.degrees == (1, 1, 2)  # NOTE: parts of 24: one 14 whole on each, then no room for the third


def test_work_is_balanced_over_the_ranks() -> None:
    """A long-tailed batch: the busiest rank's attention work within 5% of the mean (``balance``), with
    fewer sequences split than kept whole."""
    g = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in (torch.empty(48).log_normal_(3.0, 1.0, generator=g).clamp(2, 600))]
    seqs = _sequences(*lengths)
    pb = pack_sequences(seqs, ranks=4, tokens=4 * ((sum(lengths) + 200) // 4), balance=0.05)
    work = pb.attention_work()
    assert max(work) <= 1.05 * sum(work) / len(work), work
    assert 0 < len(pb.degrees) - pb.degrees.count(1) < pb.degrees.count(1), pb.degrees


def test_bad_batches_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split into 4 equal parts"):
        pack_sequences(_sequences(3), ranks=4, tokens=10)
    with pytest.raises(ValueError, match="do not fit in 16"):
        pack_sequences(_sequences(10, 10), ranks=2, tokens=16)


def test_the_packed_row_trains_as_the_sequences_in_order() -> None:
    """The model over the packed row (tokens of a sequence apart, out of order) equals one device's row
    of the same sequences in order: the loss and every gradient."""
    pytest.importorskip("transformers")
    from meshfold.tools.zoo import build
    from meshfold.tools.zoo.hf_zoo import PACKED_LENGTHS, PACKED_TOKENS

    seqs = _sequences(*PACKED_LENGTHS)
    results = []
    for ranks in (1, 4):
        net, _ = build("hf-llama-packed")
        net = net.double()
        loss = net(*pack_sequences(seqs, ranks=ranks, tokens=PACKED_TOKENS).inputs())
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in net.named_parameters()}))
    (one, grads), (packed, packed_grads) = results
    torch.testing.assert_close(packed, one)
    for name, g in grads.items():
        torch.testing.assert_close(packed_grads[name], g, msg=name)


def _reach(mask: torch.Tensor, cp: int) -> Reach:
    """``decide`` on every rank's ``measure`` of its rows of the whole ``mask`` ``[T, T]``."""
    return decide(torch.stack([measure(rows[None, None], cp) for rows in mask.chunk(cp)]))


def _contiguous(reach: Reach) -> Route:
    assert reach.layout == "contiguous" and reach.route is not None, reach
    return reach.route


def _seen_by_others(mask: torch.Tensor, cp: int) -> list[set[int]]:
    """Per rank's key block, the columns (within it) some other rank's rows see."""
    block = mask.shape[1] // cp
    out = []
    for j in range(cp):
        rows = torch.cat([r for i, r in enumerate(mask.chunk(cp)) if i != j])
        out.append(set(rows[:, j * block : (j + 1) * block].any(0).nonzero().flatten().tolist()))
    return out


def test_reach_of_a_causal_mask_is_the_zigzag_layout() -> None:
    i = torch.arange(32)
    reach = _reach(i[:, None] >= i[None, :], 4)
    assert reach == Reach("zigzag")


def test_reach_of_a_packed_row_sends_only_what_others_see() -> None:
    """Each block's span is exactly the columns other ranks' rows see; per-sequence degrees leave
    less of the row to travel than one fixed degree."""
    travels = []
    for split_above in (None, 0):
        pb = pack_sequences(_sequences(*LENGTHS), ranks=4, tokens=96, split_above=split_above)
        mask = doc_mask(pb.doc_ids, pb.position_ids)[0, 0]
        reach = _reach(mask, 4)
        route = _contiguous(reach)
        for (start, end), seen in zip(route.spans, _seen_by_others(mask, 4), strict=True):
            assert seen and min(seen) == start and max(seen) == end - 1
        assert route.hops == (3, 3, 3, 3)  # NOTE: a split sequence's chunks are seen all round the ring
        travels.append(sum(e - s for s, e in route.spans))
    assert travels[0] < 0.6 * travels[1] and travels[1] <= 96, travels


def test_reach_of_a_sliding_window_and_of_blocks_nobody_sees() -> None:
    i = torch.arange(32)
    window = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3)
    reach = _reach(window, 4)
    # NOTE: the window reaches two keys back: the next rank sees the last two columns of each block, and
    # only it: they travel one step
    route = _contiguous(reach)
    assert (route.spans, route.hops) == (((6, 8), (6, 8), (6, 8), (0, 0)), (1, 1, 1, 0))
    # NOTE: what TokenRing sends instead: the first two rows of each part see into the part before
    for r in range(4):
        want = [(0, 2) if j == r - 1 else (0, 8) if j == r else (0, 0) for j in range(4)]
        assert list(route.queries[r]) == want, (r, route.queries[r])
    alone = torch.block_diag(*[torch.ones(8, 8, dtype=torch.bool)] * 4)
    route = _contiguous(_reach(alone, 4))
    assert (route.spans, route.hops) == (((0, 0),) * 4, (0,) * 4)
    additive = torch.zeros(32, 32).masked_fill(~window, float("-inf"))
    assert _reach(additive, 4) == reach


def test_reach_of_a_mask_hiding_with_the_lowest_value() -> None:
    """HF's eager masks hide with the dtype's lowest value: a causal one still reads as causal (the
    zigzag layout); a row hiding every key that way weighs them all, so every block travels."""
    i = torch.arange(32)
    low = torch.finfo(torch.float32).min
    causal = torch.zeros(32, 32).masked_fill(i[None, :] > i[:, None], low)
    assert _reach(causal, 4) == _reach(i[:, None] >= i[None, :], 4)
    alone = torch.zeros(32, 32).masked_fill(~torch.block_diag(*[torch.ones(8, 8, dtype=torch.bool)] * 4), low)
    assert _contiguous(_reach(alone, 4)).spans == ((0, 0),) * 4
    alone[9] = low  # NOTE: rank 1's second row hides every key: every other block travels as far as rank 1
    route = _contiguous(_reach(alone, 4))
    assert (route.spans, route.hops) == (((0, 8), (0, 0), (0, 8), (0, 8)), (1, 0, 3, 2))
    assert route.queries[1] == ((1, 2), (0, 8), (1, 2), (1, 2))


def test_lowest_value_masks_hide_with_minus_infinity_where_their_row_sees_a_key() -> None:
    """What the ring kernels skip blocks by: the same weights, -inf for -inf, but a row hiding every key
    keeps its lowest values (it weighs all keys alike, as one device does)."""
    i = torch.arange(8)
    low = torch.finfo(torch.float32).min
    eager = torch.zeros(8, 8).masked_fill(i[None, :] > i[:, None], low)
    eager[3] = low
    got = canonical(eager)
    want = torch.zeros(8, 8).masked_fill(i[None, :] > i[:, None], float("-inf"))
    want[3] = low
    assert torch.equal(got, want)
    q, k, v = (torch.randn(1, 1, 8, 4, generator=torch.Generator().manual_seed(s)) for s in range(3))
    for a, b in zip(
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=eager)[:2],
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=got)[:2],
        strict=True,
    ):
        assert torch.equal(a, b)
    causal = i[:, None] >= i[None, :]
    assert canonical(causal) is causal
