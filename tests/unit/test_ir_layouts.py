"""The IR's own meaning of its data: shard bounds and local shapes of a layout, each collective's
layout transfer and wire volume, and the view trait — checked against independent computations
(``torch.chunk`` on real tensors, ring algorithms run step by step, real aliasing)."""

from __future__ import annotations

import itertools
import math

import pytest
import sympy
import torch

from meshfold.ir import Layout, Mesh, Partial, Placement, R, Shard, TensorType, collective_for, view_trait
from meshfold.ir.ops import (
    ALL_GATHER,
    ALL_GATHER_BUCKET,
    ALL_REDUCE,
    ALL_TO_ALL,
    PARTIAL,
    REDISTRIBUTE,
    REDUCE_SCATTER,
    REDUCE_SCATTER_BUCKET,
    SHARD,
    WAIT,
    OpDef,
)

aten = torch.ops.aten
MESH = Mesh.of(dp=2, tp=3)


def _chunked(x: torch.Tensor, layout: Layout, mesh: Mesh, coord: tuple[int, ...]) -> torch.Tensor:
    """Independent: torch.chunk per Shard axis in mesh order (outer axis first)."""
    for i, p in enumerate(layout.placements):
        if isinstance(p, Shard):
            x = torch.chunk(x, mesh.sizes[i], p.dim)[coord[i]]
    return x


LAYOUTS = [
    Layout.on(MESH, dp=Shard(0), tp=Shard(1)),
    Layout.on(MESH, dp=Shard(0), tp=Shard(0)),  # one dim over both axes
    Layout.on(MESH, dp=Shard(1), tp=Shard(1)),
    Layout.on(MESH, dp=Partial(), tp=Shard(2)),
    Layout.on(MESH, tp=Partial("max")),
    Layout.replicated(MESH),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_shard_bounds_pick_the_chunk_torch_chunk_picks(layout: Layout) -> None:
    x = torch.arange(12 * 18 * 6).reshape(12, 18, 6)
    for coord in itertools.product(*(range(n) for n in MESH.sizes)):
        bounds = layout.shard_bounds(x.shape, MESH, coord)
        piece = x
        for d, (lo, size) in enumerate(bounds):
            piece = piece.narrow(d, lo, size)
        want = _chunked(x, layout, MESH, coord)
        assert torch.equal(piece, want), f"{layout} at {coord}"
        assert layout.local_shape(x.shape, MESH, coord) == tuple(want.shape)


def test_a_dim_over_two_axes_nests_outer_axis_first() -> None:
    layout = Layout.on(MESH, dp=Shard(0), tp=Shard(0))
    assert layout.shard_bounds((12, 5), MESH, (1, 2)) == ((6 + 2 * 2, 2), (0, 5))
    assert layout.shard_bounds((12, 5), MESH, (0, 1)) == ((2, 2), (0, 5))
    assert layout.local_shape((12, 5), MESH) == (2, 5)


def test_partial_and_replicate_keep_the_whole_shape() -> None:
    assert Layout.on(MESH, dp=Partial(), tp=Partial("avg")).local_shape((7, 5), MESH, (1, 2)) == (7, 5)
    assert Layout.on(MESH, dp=Partial(), tp=Shard(1)).shard_bounds((7, 6), MESH, (1, 2)) == ((0, 7), (4, 2))
    assert Layout.replicated(MESH).local_shape((), MESH) == ()


def test_uneven_split_is_refused_naming_dim_and_axis() -> None:
    with pytest.raises(ValueError, match=r"dim 1 \(size 7\).*'tp'"):
        Layout.on(MESH, tp=Shard(1)).local_shape((4, 7), MESH)
    # NOTE: even over the outer axis, uneven over the inner one (12 / 2 = 6, 6 / 4 is not whole)
    mesh = Mesh.of(a=2, b=4)
    with pytest.raises(ValueError, match=r"size 6.*'b'"):
        Layout.on(mesh, a=Shard(0), b=Shard(0)).shard_bounds((12,), mesh, (0, 0))


def test_symbolic_sizes_split_only_where_every_value_divides() -> None:
    s = sympy.Symbol("s", integer=True, positive=True)
    layout = Layout.on(MESH, dp=Shard(0))
    assert layout.local_shape((2 * s - 2, 4), MESH) == (s - 1, 4)
    assert layout.shard_bounds((2 * s, 4), MESH, (1, 0)) == ((s, s), (0, 4))
    assert Layout.on(MESH, dp=Shard(1)).local_shape((s, 4), MESH) == (s, 2)
    with pytest.raises(ValueError, match="does not divide"):
        layout.local_shape((s, 4), MESH)


# NOTE: (op, attrs, operand index, operand placement on tp, result placement on tp)
TRANSFERS: list[tuple[OpDef, dict[str, object], int, Placement, Placement]] = [
    (ALL_GATHER, {"dim": 1}, 0, Shard(1), R),
    (REDUCE_SCATTER, {"dim": 0, "reduce": "avg"}, 0, Partial("avg"), Shard(0)),
    (ALL_REDUCE, {"reduce": "max"}, 0, Partial("max"), R),
    (ALL_TO_ALL, {"split_dim": 1, "concat_dim": 0}, 0, Shard(0), Shard(1)),
    (SHARD, {"dim": 1}, 0, R, Shard(1)),
    (PARTIAL, {"reduce": "sum"}, 0, R, Partial("sum")),
    (ALL_GATHER_BUCKET, {"dims": (0, 1)}, 1, Shard(1), R),
    (REDUCE_SCATTER_BUCKET, {"dims": (1, 0), "reduce": "sum"}, 0, Partial("sum"), Shard(1)),
]


@pytest.mark.parametrize(("op", "attrs", "k", "src", "dst"), TRANSFERS, ids=lambda v: str(v))
def test_transfer_changes_only_the_collectives_axis(
    op: OpDef, attrs: dict[str, object], k: int, src: Placement, dst: Placement
) -> None:
    full = {"axis": "tp", **attrs}
    assert op.moves(full, k) == (src, dst)
    before = Layout.on(MESH, dp=Shard(0), tp=src)
    assert op.transfer(before, full, k) == Layout.on(MESH, dp=Shard(0), tp=dst)
    wrong = Layout.on(MESH, dp=Shard(0), tp=Partial("max") if src == R else R)
    with pytest.raises(ValueError, match="takes"):
        op.transfer(wrong, full, k)


def test_ops_without_a_fixed_transfer_say_so() -> None:
    for op in (REDISTRIBUTE, WAIT):
        assert op.move is None and op.wire_bytes(100.0, 4) == 0.0
        with pytest.raises(ValueError, match="no fixed layout transfer"):
            op.moves({"axis": "tp"})


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (Shard(0), R),
        (Shard(0), Shard(1)),
        (Partial("avg"), R),
        (Partial(), Shard(1)),
        (R, Shard(0)),
        (R, Partial("max")),
    ],
    ids=str,
)
def test_collective_for_is_the_op_whose_transfer_does_it(src: Placement, dst: Placement) -> None:
    op, attrs = collective_for(src, dst)
    layout = Layout.on(MESH, dp=src)
    assert op.transfer(layout, {"axis": "dp", **dict(attrs)}) == Layout.on(MESH, dp=dst)


def test_collective_for_refuses_two_step_moves() -> None:
    for src, dst in [(Shard(0), Partial()), (Partial("sum"), Partial("max")), (R, R)]:
        with pytest.raises(ValueError, match="no single collective"):
            collective_for(src, dst)


def _ring_reduce_scatter(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Run a ring reduce-scatter; return each rank's reduced chunk and the bytes rank 0 sent."""
    n = len(parts)
    chunks = [list(torch.chunk(p.clone(), n)) for p in parts]
    sent = 0
    for step in range(n - 1):
        msgs = [(r, (r - step - 1) % n, chunks[r][(r - step - 1) % n]) for r in range(n)]
        for r, c, payload in msgs:
            sent += payload.numel() * payload.element_size() if r == 0 else 0
            chunks[(r + 1) % n][c] = chunks[(r + 1) % n][c] + payload
    return [chunks[r][r] for r in range(n)], sent


def _ring_all_gather(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Run a ring all-gather; return each rank's gathered tensor and the bytes rank 0 sent."""
    n = len(parts)
    have = [{r: parts[r]} for r in range(n)]
    sent = 0
    for step in range(n - 1):
        msgs = [(r, (r - step) % n) for r in range(n)]
        for r, c in msgs:
            payload = have[r][c]
            sent += payload.numel() * payload.element_size() if r == 0 else 0
            have[(r + 1) % n][c] = payload
    return [torch.cat([have[r][c] for c in range(n)]) for r in range(n)], sent


@pytest.mark.parametrize("n", [2, 3, 4])
def test_wire_bytes_equal_what_ring_algorithms_send(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    parts = [torch.randn(4 * n, 3, generator=gen) for _ in range(n)]
    b = parts[0].numel() * parts[0].element_size()

    scattered, sent = _ring_reduce_scatter(parts)
    total = sum(parts, torch.zeros_like(parts[0]))
    for r in range(n):
        torch.testing.assert_close(scattered[r], torch.chunk(total, n)[r])
    assert REDUCE_SCATTER.wire_bytes(b, n) == pytest.approx(sent)
    assert REDUCE_SCATTER_BUCKET.wire_bytes(b, n) == pytest.approx(sent)

    gathered, sent_ag = _ring_all_gather(parts)
    assert all(torch.equal(g, torch.cat(parts)) for g in gathered)
    assert ALL_GATHER.wire_bytes(b, n) == pytest.approx(sent_ag)
    assert ALL_GATHER_BUCKET.wire_bytes(b, n) == pytest.approx(sent_ag)

    # NOTE: all-reduce = reduce-scatter, then all-gather of the reduced chunks
    _, sent_chunks = _ring_all_gather(scattered)
    assert ALL_REDUCE.wire_bytes(b, n) == pytest.approx(sent + sent_chunks)

    # NOTE: all-to-all sends every block but its own (one of n) to its peer
    blocks = torch.chunk(parts[0], n)
    assert ALL_TO_ALL.wire_bytes(b, n) == pytest.approx(sum(x.numel() * 4 for x in blocks[1:]))

    assert SHARD.wire_bytes(b, n) == 0.0 and PARTIAL.wire_bytes(b, n) == 0.0
    assert ALL_GATHER.wire_bytes(b, 1) == 0.0 and ALL_REDUCE.wire_bytes(b, 1) == 0.0


def test_wire_bytes_of_a_global_type_use_the_operands_local_shard() -> None:
    t = TensorType((12, 18), torch.float32)
    layout = Layout.on(MESH, dp=Shard(0), tp=Shard(1))
    local = math.prod(torch.empty(12, 18).chunk(2, 0)[0].chunk(3, 1)[0].shape) * 4
    assert ALL_GATHER.wire_bytes_of(t, layout, MESH, {"axis": "tp", "dim": 1}) == local * 2
    assert ALL_GATHER.wire_bytes_of(t, layout, MESH, {"axis": "dp", "dim": 0}) == local * 1
    assert SHARD.wire_bytes_of(t, Layout.replicated(MESH), MESH, {"axis": "tp", "dim": 0}) == 0.0


VIEW_CASES = [
    (aten.view.default, (torch.randn(4, 6), [6, 4])),
    (aten._unsafe_view.default, (torch.randn(4, 6), [24])),
    (aten.reshape.default, (torch.randn(4, 6), [2, 12])),
    (aten.unflatten.int, (torch.randn(4, 6), 1, [2, 3])),
    (aten.t.default, (torch.randn(4, 6),)),
    (aten.permute.default, (torch.randn(2, 3, 4), [2, 0, 1])),
    (aten.slice.Tensor, (torch.randn(4, 6), 1, 1, 4)),
    (aten.expand.default, (torch.randn(1, 6), [3, 6])),
    (aten.mm.default, (torch.randn(4, 6), torch.randn(6, 2))),
    (aten.clone.default, (torch.randn(4, 6),)),
    (aten._to_copy.default, (torch.randn(4, 6),)),
    (aten.add.Tensor, (torch.randn(4, 6), 1.0)),
]


@pytest.mark.parametrize(("target", "args"), VIEW_CASES, ids=lambda v: str(v) if not isinstance(v, tuple) else "")
def test_view_trait_matches_real_aliasing(target: object, args: tuple[object, ...]) -> None:
    trait = view_trait(target)  # type: ignore[arg-type]
    x = args[0]
    assert isinstance(x, torch.Tensor)
    out = target(*args)  # type: ignore[operator]
    shares = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert (trait is not None) == shares, f"{target}: trait {trait}, shares storage {shares}"
    if trait is not None and trait.reshape:
        assert torch.equal(out, x.reshape(out.shape)), f"{target} is not a row-major reshape"
    if trait is not None:
        assert trait.strided == (target in (aten.view.default, aten._unsafe_view.default))


def test_own_ops_are_never_views() -> None:
    assert view_trait(ALL_GATHER) is None and view_trait(REDISTRIBUTE) is None
