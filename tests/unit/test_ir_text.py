"""The text form: exact round trip for every kind of literal, type and layout; clear parse errors."""

from __future__ import annotations

import pytest
import sympy
import torch

from meshfold import ir
from meshfold.ir import GraphBuilder, Layout, Mesh, Partial, Provenance, Shard, TensorType, TextPosition, parse
from meshfold.ir.graph import first_difference

aten = torch.ops.aten
F32 = torch.float32


def _sample_graph() -> ir.Graph:
    mesh = Mesh.of(dp=2, tp=4)
    b = GraphBuilder("sample", mesh)
    w = b.add_input("param", "layers.0.w", TensorType((16, 8), F32), Layout.on(mesh, tp=Shard(0)))
    x = b.add_input("input", "x", TensorType((4, 8), F32), Layout.on(mesh, dp=Shard(0)))
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    (t,) = b.add_op(
        aten.t.default, (w,), (), [("t", TensorType((8, 16), F32))], Provenance("layers.0", "fwd", "m.py:3")
    )
    (mm,) = b.add_op(
        aten.mm.default,
        (x, t),
        (),
        [ir.Value("mm", TensorType((4, 16), F32), Layout.on(mesh, dp=Shard(0), tp=Partial("sum")))],
        Provenance("layers.0", "fwd", "m.py:3"),
    )
    (full,) = b.add_op(
        aten.full.default,
        ((2, 3), float("-inf")),
        (("dtype", torch.bfloat16), ("layout", torch.strided), ("device", torch.device("cpu")), ("pin_memory", False)),
        [("full", TensorType((2, 3), torch.bfloat16))],
    )
    b.add_op(
        aten.native_layer_norm.default,
        (mm, (16,), None, None, 1e-05),
        (),
        [("ln", TensorType((4, 16), F32)), ("mean", TensorType((4, 1), F32)), ("rstd", TensorType((4, 1), F32))],
        Provenance("", "bwd"),
    )
    b.add_op(
        aten.view.default,
        (full, (6,)),
        (("sym", 2 * s0 + 1), ("s", 'a "quoted" #str'), ("m", None)),
        [("v", TensorType((2 * s0, 6), F32))],
    )
    b.add_op(
        aten.clone.default, (mm,), (("memory_format", torch.contiguous_format),), [("c", TensorType((4, 16), F32))]
    )
    b.add_output("out", "0", mm)
    b.add_output("grad", "layers.0.w", t)
    return b.build()


def test_round_trip_is_exact() -> None:
    text = str(_sample_graph())
    assert str(parse(text)) == text
    # NOTE: the text spells every feature the way the design shows it.
    assert "param %layers.0.w : f32[16, 8] {tp: S(0)}" in text
    assert "%mm = aten.mm(%x, %t) : f32[4, 16] {dp: S(0), tp: P(sum)}  # layers.0 fwd @m.py:3" in text
    assert "-inf" in text and "torch.bfloat16" in text and 'device("cpu")' in text
    assert "%ln, %mean, %rstd = aten.native_layer_norm(%mm, [16], None, None, 1e-05)" in text
    assert "f32[2*s0, 6]" in text and "sym(2*s0 + 1)" in text


def test_parsed_graph_has_the_same_structure() -> None:
    g = _sample_graph()
    h = parse(str(g))
    assert [i.kind for i in h.inputs] == [i.kind for i in g.inputs]
    assert [op.target for op in h.ops] == [op.target for op in g.ops]
    assert [r.type for op in h.ops for r in op.results] == [r.type for op in g.ops for r in op.results]
    assert [r.layout for op in h.ops for r in op.results] == [r.layout for op in g.ops for r in op.results]
    assert h.ops[0].prov == Provenance("layers.0", "fwd", "m.py:3")
    assert h.ops[3].prov == Provenance("", "bwd")
    assert h.ops[4].kwarg("s") == 'a "quoted" #str'
    assert h.ops[1].operands == (h.inputs[1].value, h.ops[0].result)
    assert h.output("grad", "layers.0.w").value is h.ops[0].result


def test_names_are_made_unique_deterministically() -> None:
    b = GraphBuilder("names")
    x = b.add_input("input", "x", TensorType((2,), F32))
    vals = [x]
    for _ in range(3):
        (v,) = b.add_op(aten.neg.default, (vals[-1],), (), [("x", TensorType((2,), F32))])
        vals.append(v)
    b.add_output("out", "0", vals[-1])
    text = str(b.build())
    assert "%x_1 = aten.neg(%x)" in text and "%x_3 = aten.neg(%x_2)" in text
    assert str(parse(text)) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("graph @g {\n  input %x : f33[2]\n}\n", "unknown dtype 'f33'"),
        ("graph @g {\n  %y = aten.neg(%x) : f32[2]\n}\n", "%x is used before it is defined"),
        ("graph @g {\n  input %x : f32[2]\n  %y = aten.nope(%x) : f32[2]\n}\n", "unknown op 'aten.nope'"),
        ("graph @g {\n  input %x : f32[2] {tp: S(0)}\n}\n", "a layout needs a mesh"),
        ("graph @g mesh<dp=2> {\n  input %x : f32[2] {tp: S(0)}\n}\n", "layout names axes ['tp']"),
        ("graph @g {\n  input %x : f32[2]\n  input %x : f32[2]\n}\n", "%x is defined twice"),
        ("graph @g {\n  input %x : f32[2]\n", "missing closing"),
        ("graph @g {\n  input %x : f32[__import__('os')]\n}\n", "dimension"),
        ("graph @g {\n  input %x : f32[2]\n  %y = aten.add.Tensor(%x, os.system) : f32[2]\n}\n", "unknown literal"),
    ],
)
def test_parse_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse(text)


def test_parse_errors_carry_line_numbers() -> None:
    with pytest.raises(ir.ParseError, match="line 3"):
        parse("graph @g {\n  input %x : f32[2]\n  %y = aten.neg(%z) : f32[2]\n}\n")


def test_parse_knows_where_the_text_wrote_each_input_op_and_output() -> None:
    text = (
        "graph @g {\n"
        "  input %x : f32[2]\n"
        "  // a note\n"
        "  %y = aten.neg(%x) : f32[2]  # m fwd @m.py:1\n"
        "  output out(0) = %y\n"
        "}\n"
    )
    g = parse(text, file="g.ir")
    (op,) = g.ops
    assert g.position_of(g.inputs[0].value) == TextPosition("g.ir", 2, 3)
    assert g.position_of(op) == op.prov.position == TextPosition("g.ir", 4, 3)
    assert g.position_of(g.outputs[0]) == TextPosition("g.ir", 5, 3)
    # NOTE: errors of passes describe ops this way; the verifier's lead with the position instead.
    assert op.describe() == "aten.neg at m (fwd, m.py:1) [g.ir:4:3]"
    assert op.describe(position=False) == "aten.neg at m (fwd, m.py:1)"
    assert parse(text).ops[0].describe() == "aten.neg at m (fwd, m.py:1) [line 4, column 3]"


def test_positions_are_neither_printed_nor_compared() -> None:
    built = _sample_graph()
    text = str(built)
    moved = parse("// a comment moves every line down\n" + text.replace("\n  ", "\n      "), file="moved.ir")
    assert str(moved) == text
    assert moved.ops[1].prov.position == TextPosition("moved.ir", 6, 7)
    assert first_difference(moved, built) is None
    assert [op.prov for op in moved.ops] == [op.prov for op in built.ops]
    assert len({op.prov for op in moved.ops} | {op.prov for op in built.ops}) == len({op.prov for op in built.ops})
    # NOTE: ops built in code keep a plain Provenance: no position, and no slot for one.
    assert all(type(op.prov) is Provenance and op.prov.position is None for op in built.ops)
    assert all(op.describe() == op.describe(position=False) for op in built.ops)


def test_comment_lines_are_ignored() -> None:
    text = "// RUN: cleanup\ngraph @g {\n  input %x : f32[2]\n  output out(0) = %x\n}\n// CHECK: x\n"
    assert str(parse(text)) == "graph @g {\n  input %x : f32[2]\n  output out(0) = %x\n}\n"


def test_own_ops_round_trip() -> None:
    mesh = Mesh.of(tp=2)
    b = GraphBuilder("comm", mesh)
    x = b.add_input("input", "x", TensorType((4, 8), F32), Layout.on(mesh, tp=Shard(0)))
    (y,) = b.add_op(ir.ops.ALL_GATHER, (x,), (("axis", "tp"), ("dim", 0)), [("y", TensorType((8, 8), F32))])
    b.add_output("out", "0", y)
    text = str(b.build())
    assert 'comm.all_gather(%x, axis="tp", dim=0)' in text
    assert str(parse(text)) == text


def test_stack_lines_round_trip_and_reject_bad_members() -> None:
    text = (
        "graph @g {\n"
        "  param %e.down_proj : f32[2, 3, 4]\n"
        '  stack %e.down_proj = [["e.0.w2.weight"], ["e.1.w2.weight"]]\n'
        "  output out(0) = %e.down_proj\n"
        "}\n"
    )
    g = parse(text)
    assert g.stacks == (ir.ParamStack("e.down_proj", (("e.0.w2.weight",), ("e.1.w2.weight",))),)
    assert str(g) == text
    with pytest.raises(ir.ParseError, match=r"line 3, column 23: .*JSON list of lists of names"):
        parse(text.replace('[["e.0.w2.weight"], ["e.1.w2.weight"]]', '["e.0.w2.weight"]'))


def test_interpreted_views_run_on_real_strides() -> None:
    """A view recorded on the strides seen while tracing runs as a reshape on real tensors, whose
    strides may differ (here the input arrives transposed, which a plain view cannot flatten)."""
    from meshfold.backends.interpret import interpret

    g = parse("graph @g {\n  input %x : f32[2, 4]\n  %y = aten.view(%x, [8]) : f32[8]\n  output out(0) = %y\n}\n")
    x = torch.arange(8.0).reshape(4, 2).t()
    assert not x.is_contiguous()
    torch.testing.assert_close(interpret(g, {"x": x})[("out", "0")], x.reshape(8))
