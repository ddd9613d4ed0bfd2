"""Hostile IR text gets one clean error line: never a traceback, a hang or an allocation first.

Every file in ``tests/ir_corpus/`` starts with ``// ERROR: <fragment>``; the fragment must appear in
the error from ``ir.parse`` (+ ``ir.verify`` when it parses), and in pass-debug's single stderr line
with the file's name for the position. Both start with where the text is wrong: ``line L, column C: ``
(the column as editors count it) for text without a name, ``<file>:L:C: `` for a file; the verifier's
then name the op or input. Cases too large for a file (10,000 nested brackets) are generated here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from meshfold import ir
from meshfold.ir.graph import GraphBuilder
from meshfold.ir.types import TensorType
from meshfold.tools.pass_debug import main

CORPUS = Path(__file__).resolve().parent.parent / "ir_corpus"
FILES = sorted(CORPUS.glob("*.ir"))
DEEP = 10_000


def _expected(path: Path) -> str:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("// ERROR: "), f"{path.name}: first line must be `// ERROR: <fragment>`"
    return first.removeprefix("// ERROR: ")


def _error_of(text: str, file: str | None = None) -> tuple[str, str]:
    """(stage, message) of the error ``text`` (named ``file``) raises: parse errors first, then verify errors."""
    try:
        graph = ir.parse(text, file)
    except ir.ParseError as e:
        return "parse", str(e)
    with pytest.raises(ir.VerifyError) as info:
        ir.verify(graph)
    return "verify", str(info.value)


def _in_file(needle: str, path: Path) -> str:
    """``needle`` as an error about the file ``path`` reads it: ``line L, column C: `` becomes ``<path>:L:C: ``."""
    return re.sub(r"^line (\d+), column (\d+)", lambda m: f"{path}:{m[1]}:{m[2]}", needle)


def _pass_debug_error(path: Path, stage: str, capsys: pytest.CaptureFixture[str]) -> str:
    # NOTE: pass-debug verifies its input only with --verify, so verifier cases pass it.
    argv = [str(path), "-p", "cleanup", *(["--verify"] if stage == "verify" else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("pass-debug: error: ")
    return err


def test_corpus_is_there() -> None:
    assert len(FILES) >= 11


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_corpus_file_gets_its_error(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    needle = _expected(path)
    stage, message = _error_of(path.read_text(encoding="utf-8"))
    assert needle in message
    assert "\n" not in message
    assert re.match(r"line \d+, column \d+: ", message), message
    if stage == "parse":
        assert re.match(r"line \d+, column \d+: ", needle), f"{path.name}: the fragment must name the position"
    else:
        assert re.match(r"line \d+, column \d+: (aten\.\w+ at |input ).*%\w+", needle), (
            f"{path.name}: the fragment must name the position, the op or input, and the value"
        )
    named = _error_of(path.read_text(encoding="utf-8"), str(path))
    assert named[0] == stage and named[1].startswith(f"{path}:") and _in_file(needle, path) in named[1], named
    err = _pass_debug_error(path, stage, capsys)
    assert _in_file(needle, path) in err
    if stage == "parse":
        assert f"cannot parse IR: {path}:" in err


def _op_line(arg: str) -> str:
    return f"graph @g {{\n  input %x : f32[8]\n  %y = aten.view(%x, {arg}) : f32[8]\n  output out(0) = %y\n}}\n"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (_op_line("[" * DEEP + "]" * DEEP), "line 3, column 86: list arguments nest deeper than 64 levels"),
        (_op_line("[sym(" + "(" * DEEP + "1" + ")" * DEEP + ")]"), "line 3, column 27: bad dimension"),
        (_op_line("[sym(" + "-" * DEEP + "1)]"), "nests deeper than 64 levels"),
        ("graph @g {\n  input %x : f32[" + "[" * DEEP + "]" * DEEP + "]\n}\n", "line 2, column 18: bad dimension"),
        ("graph @g {\n  input %x : f32[" + "(" * DEEP + "8" + ")" * DEEP + "]\n}\n", "nests deeper"),
        ("graph @g mesh<dp=2> {\n  input %x : f32[8] {" + "{" * DEEP + "}" * DEEP + "}\n}\n", "line 2, column 22"),
        ("graph @g {\n  param %p : f32[2]\n  stack %p = " + "[" * DEEP + "]" * DEEP + "\n}\n", "line 3, column 13"),
        ("graph @g mesh<dp=99999999999> {\n}\n", "line 1, column 10: bad mesh header"),
        ("graph @g {\n  input %x : f32[" + "9" * DEEP + "]\n}\n", "line 2, column 18: bad dimension"),
        ("graph @g {\n  input %x : f32[8]\n  output out(0) = %x\n}\n}\n", "line 5, column 1: text after"),
        ("", "line 1, column 1: empty input"),
    ],
    ids=[
        "deep-list",
        "deep-parens-in-sym",
        "deep-unary-minus",
        "deep-brackets-in-type",
        "deep-parens-in-type",
        "deep-braces-in-layout",
        "deep-stack",
        "huge-mesh-axis",
        "huge-int-in-type",
        "second-closing-brace",
        "empty",
    ],
)
def test_generated_hostile_text(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str) -> None:
    stage, message = _error_of(text)
    assert stage == "parse" and needle in message and "\n" not in message
    path = tmp_path / "hostile.ir"
    path.write_text(text, encoding="utf-8")
    assert _in_file(needle, path) in _pass_debug_error(path, stage, capsys)


@pytest.mark.parametrize(
    ("shape", "needle"),
    [((-8, 32), "has a negative dimension -8"), ((99999999999, 99999999999), "elements; the limit is 2**62")],
)
def test_verifier_checks_sizes_before_allocating(shape: tuple[int, ...], needle: str) -> None:
    """Graphs built in code skip the parser; the verifier checks their sizes before any fake tensor."""
    b = GraphBuilder("g", None)
    x = b.add_input("input", "x", TensorType(shape, torch.float32), ir.Layout())
    (y,) = b.add_op(torch.ops.aten.neg.default, [x], [], [("y", TensorType(shape, torch.float32))])
    b.add_output("out", "0", y)
    with pytest.raises(ir.VerifyError, match=r"input %x: %x : f32\[.*" + re.escape(needle)):
        ir.verify(b.build())


def test_symbolic_dims_the_printer_writes_still_parse() -> None:
    text = "graph @g {\n  input %x : f32[s0**2, 2*s0 + 3, (s0//2), Max(s0, s1)]\n  output out(0) = %x\n}\n"
    assert str(ir.parse(text)) == text
