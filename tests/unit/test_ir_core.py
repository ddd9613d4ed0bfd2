"""Meshes, placements, layouts, types and the verifier."""

from __future__ import annotations

import pytest
import sympy
import torch

from meshfold import ir
from meshfold.ir import GraphBuilder, Layout, Mesh, Partial, R, Shard, TensorType, parse_placement, verify
from meshfold.ir.symbolic import parse_dim

aten = torch.ops.aten
F32 = torch.float32


def test_mesh_parse_and_print() -> None:
    m = Mesh.parse("dp=2, tp=4")
    assert (m.names, m.sizes, m.world_size, str(m)) == (("dp", "tp"), (2, 4), 8, "mesh<dp=2, tp=4>")
    assert Mesh.parse(str(m)) == m
    assert m.size("tp") == 4
    with pytest.raises(KeyError, match="has no axis 'pp'; its axes are"):
        m.size("pp")


@pytest.mark.parametrize("bad", ["", "dp", "dp=x", "dp=2,dp=2", "dp=0", "1x=2"])
def test_bad_meshes_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        Mesh.parse(bad)


def test_placements_are_hashable_plain_data() -> None:
    assert {Shard(0), Shard(0), R, Partial(), Partial("sum")} == {Shard(0), R, Partial()}
    for p in (Shard(1), R, Partial("max"), Partial("avg")):
        assert parse_placement(str(p)) == p
    assert parse_placement("P") == Partial("sum")
    with pytest.raises(ValueError, match="unknown placement"):
        parse_placement("X(1)")
    with pytest.raises(AttributeError):
        Shard(0).dim = 1  # type: ignore[misc]


def test_layouts() -> None:
    m = Mesh.of(dp=2, tp=2)
    lay = Layout.on(m, tp=Shard(1))
    assert str(lay) == "{tp: S(1)}" and lay.placement("dp") == R and not lay.is_replicated()
    assert Layout.replicated(m).is_replicated() and str(Layout.replicated(m)) == "{}"
    assert lay.with_placement("dp", Shard(0)) == Layout.on(m, dp=Shard(0), tp=Shard(1))
    with pytest.raises(KeyError):
        Layout.on(m, pp=R)


@pytest.mark.parametrize("text", ["7", "s0", "2*s0", "s0 + 1", "s0*s1 - 3", "FloorDiv(s0, 2)", "Max(s0, 4)", "s0**2"])
def test_symbolic_dims_round_trip(text: str) -> None:
    d = parse_dim(text)
    assert parse_dim(str(d)) == d
    assert str(parse_dim(str(d))) == str(d)


def test_symbolic_dims_never_evaluate() -> None:
    with pytest.raises(ValueError, match="unknown function"):
        parse_dim("exec(1)")
    with pytest.raises(ValueError):
        parse_dim("s0.__class__")


def test_tensor_type_of_symbolic_shape() -> None:
    s = sympy.Symbol("s0", integer=True, positive=True)
    t = TensorType((s, 4), F32)
    assert str(t) == "f32[s0, 4]" and not t.is_static() and t.numel() == 4 * s


def _mm_graph(out_shape: tuple[int, int], layout_dim: int = 0) -> ir.Graph:
    mesh = Mesh.of(tp=2)
    b = GraphBuilder("g", mesh)
    x = b.add_input("input", "x", TensorType((4, 8), F32), Layout.on(mesh, tp=Shard(layout_dim)))
    w = b.add_input("param", "w", TensorType((8, 16), F32))
    (y,) = b.add_op(
        aten.mm.default, (x, w), (), [("y", TensorType(out_shape, F32))], ir.Provenance("lin", "fwd", "m.py:9")
    )
    b.add_output("out", "0", y)
    return b.build()


def test_verifier_accepts_a_good_graph() -> None:
    verify(_mm_graph((4, 16)))


def test_verifier_checks_result_types_against_the_op() -> None:
    with pytest.raises(ir.VerifyError, match=r"aten.mm at lin \(fwd, m.py:9\): result %y is declared f32\[4, 17\]"):
        verify(_mm_graph((4, 17)))
    verify(_mm_graph((4, 17)), check_types=False)


def test_verifier_checks_layout_rank() -> None:
    with pytest.raises(ir.VerifyError, match="sharded on dim 5 over 'tp', but it has rank 2"):
        verify(_mm_graph((4, 16), layout_dim=5))


def test_verifier_checks_ssa_order() -> None:
    g = _mm_graph((4, 16))
    (op,) = g.ops
    b = GraphBuilder("g", g.mesh)
    x = b.add_input("input", "x", op.operands[0].type, op.operands[0].layout)
    b.append(ir.Op(op.target, (x, op.operands[1]), (), op.results, op.prov))
    b.add_output("out", "0", op.result)
    with pytest.raises(ir.VerifyError, match="operand %w is not defined before this op"):
        verify(b.build())


def test_verifier_checks_layout_axes_match_mesh() -> None:
    b = GraphBuilder("g", Mesh.of(dp=2))
    b.add_input("input", "x", TensorType((4,), F32), Layout.on(Mesh.of(tp=2), tp=Shard(0)))
    with pytest.raises(ir.VerifyError, match="layout axes"):
        verify(b.build())


def test_target_names_resolve_back() -> None:
    for op in (aten.mm.default, aten.add.Tensor, aten.sum.dim_IntList, ir.ops.REDUCE_SCATTER):
        assert ir.resolve_target(ir.target_name(op)) is op
    assert ir.target_name(aten.mm.default) == "aten.mm"
    with pytest.raises(ValueError, match="not an op name"):
        ir.resolve_target("os.system('x')")


def test_purity() -> None:
    assert ir.is_pure(aten.mm.default)
    assert not ir.is_pure(aten.add_.Tensor)
    assert not ir.is_pure(aten.native_dropout.default)
    assert not ir.is_pure(ir.ops.OFFLOAD)


def test_own_ops_are_one_object_each_through_copies_and_pickles() -> None:
    """meshfold's ops compare by identity (``OpDef`` is declared once per name): a graph copied or
    pickled must still hold the declared op, or ``op.target == WAIT`` would be false."""
    import copy
    import pickle

    from meshfold.ir.ops import ALL_GATHER, WAIT

    assert copy.deepcopy(WAIT) is WAIT and copy.copy(ALL_GATHER) is ALL_GATHER
    assert pickle.loads(pickle.dumps(ALL_GATHER)) is ALL_GATHER
    assert WAIT == WAIT and WAIT != ALL_GATHER and len({WAIT, copy.deepcopy(WAIT), ALL_GATHER}) == 2


def test_answers_kept_by_identity_are_each_objects_own() -> None:
    """``by_identity`` computes once per object, and an entry left by another object under the same
    id (one freed, its id reused) is never taken for this one's."""
    from meshfold.ir.memo import Kept, by_identity

    calls: list[str] = []

    def make(s: str) -> str:
        calls.append(s)
        return s.upper()

    kept: Kept[str, str] = {}
    a, b = "".join(["a", "x"]), "".join(["b", "y"])
    assert by_identity(kept, a, make) == "AX" and by_identity(kept, a, make) == "AX" and calls == ["ax"]
    kept[id(b)] = (a, "stale")  # NOTE: as if ``a`` had lived at ``b``'s address
    assert by_identity(kept, b, make) == "BY" and calls == ["ax", "by"]
    assert by_identity(kept, b, make) == "BY" and calls == ["ax", "by"]
