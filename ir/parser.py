"""Reads the text form written by :mod:`ir.printer`. Never evaluates code: every literal has a
fixed spelling and op names resolve by attribute lookup on ``torch.ops``.

Contract: any text either parses or raises :class:`ParseError` reading ``line L, column C: <what>``
(``<file>:L:C: <what>`` when given the file's name) on one line — never another exception, a hang, or
an allocation sized by the text before a check. The graph it returns knows where the text wrote each
input, op and output (``ParsedGraph.position_of``), for the verifier's and passes' errors; the printed
form never shows it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy
import torch

from meshfold.ir.cursor import Cursor, ParseError, error_at, short
from meshfold.ir.graph import (
    INPUT_KINDS,
    OUTPUT_KINDS,
    Arg,
    Graph,
    GraphBuilder,
    GraphOutput,
    Op,
    ParamStack,
    Provenance,
    TextPosition,
    TextProvenance,
    Value,
    freeze_arg,
)
from meshfold.ir.mesh import Mesh
from meshfold.ir.ops import resolve_target
from meshfold.ir.placement import Layout, Placement, R, parse_placement
from meshfold.ir.symbolic import Dim, parse_dim
from meshfold.ir.types import DTYPES_BY_NAME, ScalarType, TensorType, Type

__all__ = ["ParseError", "ParsedGraph", "parse"]

_NAME = re.compile(r"%([A-Za-z0-9_.]+)")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_NUMBER = re.compile(r"-?(?:inf|nan|\d+(?:\.\d*)?(?:e[+-]?\d+)?)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')

# NOTE: bounds on hostile text. Lists and JSON stacks nest at most MAX_DEPTH deep (no RecursionError);
# integer literals stay within int64; a tensor type has dims >= 0 and fewer than 2**62 elements in
# all, checked here, before any pass or the verifier allocates (even a fake tensor) for the shape.
MAX_DEPTH = 64
MAX_NUMEL = 2**62
MAX_MESH_AXIS = 2**20
# NOTE: a symbolic size's powers stay of degree <= MAX_DEGREE once sympy has combined them:
# ``((s0**64)**64)**64`` reads in microseconds, but a pass that substitutes a size hint would not finish.
MAX_DEGREE = 1024
_INT_RANGE = range(-(2**63), 2**63)


@dataclass(frozen=True, slots=True, eq=False)
class ParsedGraph(Graph):
    """A graph read from text: also where the text wrote each input and output (``positions``), so
    the verifier's errors about them name it; each op carries its own in a ``TextProvenance``.

    NOTE: ``positions`` is metadata of this one graph object: never printed, never compared. Passes
    build plain graphs, which keep the positions of the ops they keep (in their provenance) only."""

    positions: Mapping[Value | GraphOutput, TextPosition] = field(default_factory=dict)

    def position_of(self, item: Value | Op | GraphOutput) -> TextPosition | None:
        """Where the text wrote ``item`` (an input's value, an op or an output)."""
        if isinstance(item, Op):
            return item.prov.position
        return self.positions.get(item)


class _Parser:
    def __init__(self, file: str | None, located: bool = True) -> None:
        self.file, self.located = file, located
        self.values: dict[str, Value] = {}
        self.b: GraphBuilder | None = None
        self.positions: dict[Value | GraphOutput, TextPosition] = {}

    def value(self, ln: Cursor) -> Value:
        m = ln.match(_NAME, "a value like %x")
        if m.group(1) not in self.values:
            raise ln.error(f"%{m.group(1)} is used before it is defined", m.start())
        return self.values[m.group(1)]

    def define(self, ln: Cursor, m: re.Match[str], v: Value) -> None:
        if m.group(1) in self.values:
            raise ln.error(f"%{m.group(1)} is defined twice", m.start())
        self.values[m.group(1)] = v

    def type_(self, ln: Cursor) -> Type:
        if ln.peek("!"):
            ln.take("!")
            kind = ln.match(_IDENT, "int, float, bool or none").group(0)
            if kind not in ("int", "float", "bool", "none"):
                raise ln.error(f"unknown scalar type !{kind}")
            return ScalarType(kind)  # type: ignore[arg-type]
        dt = ln.match(_IDENT, "a dtype such as f32").group(0)
        if dt not in DTYPES_BY_NAME:
            raise ln.error(f"unknown dtype {dt!r}; known: {sorted(DTYPES_BY_NAME)}")
        ln.take("[")
        start = ln.pos
        body = ln.until_close("[", "]")
        dims: list[Dim] = []
        for offset, text in _split_top(body) if body.strip() else []:
            dims.append(_dim(ln, text, start + offset))
        _check_numel(ln, dims, start)
        return TensorType(tuple(dims), DTYPES_BY_NAME[dt])

    def layout(self, ln: Cursor, mesh: Mesh | None) -> Layout:
        if not ln.peek("{"):
            return Layout.replicated(mesh)
        ln.take("{")
        start = ln.pos
        body = ln.until_close("{", "}")
        given: dict[str, Placement] = {}
        for offset, item in _split_top(body) if body.strip() else []:
            axis, sep, pl = item.partition(":")
            if not sep:
                raise ln.error(f"layout entry {item!r} must look like axis: S(0)", start + offset)
            try:
                given[axis.strip()] = parse_placement(pl)
            except ValueError as e:
                raise ln.error(str(e), start + offset) from None
        if mesh is None:
            if given:
                raise ln.error("a layout needs a mesh; write `graph @name mesh<dp=2> {`")
            return Layout()
        unknown = set(given) - set(mesh.names)
        if unknown:
            raise ln.error(f"layout names axes {sorted(unknown)} that {mesh} lacks")
        return Layout(mesh.names, tuple(given.get(n, R) for n in mesh.names))

    def arg(self, ln: Cursor, depth: int = 0) -> Arg:
        ln.ws()
        if ln.peek("%"):
            return self.value(ln)
        if ln.peek("["):
            if depth >= MAX_DEPTH:
                raise ln.error(f"list arguments nest deeper than {MAX_DEPTH} levels")
            ln.take("[")
            items: list[Arg] = []
            while not ln.peek("]"):
                items.append(self.arg(ln, depth + 1))
                if not ln.peek("]"):
                    ln.take(",")
                    if ln.peek("]"):
                        raise ln.error("expected a list item after ','")
            ln.take("]")
            return tuple(items)
        if ln.peek('"'):
            return self.string(ln, "a string")
        if ln.peek("sym("):
            ln.take("sym(")
            start = ln.pos
            return _dim(ln, ln.until_close("(", ")"), start)
        if ln.peek("device("):
            ln.take("device(")
            start = ln.pos
            s = self.string(ln, "a device string")
            ln.take(")")
            try:
                return torch.device(s)
            except (RuntimeError, ValueError):
                raise ln.error(f'unknown device {s!r}; expected e.g. "cpu" or "cuda:0"', start) from None
        m = _NUMBER.match(ln.text, ln.pos)
        if m is not None and not _IDENT.match(ln.text, m.end()):
            tok = m.group(0)
            if any(c in tok for c in ".en") or "inf" in tok:
                ln.pos = m.end()
                return float(tok)
            if len(tok) > 20 or int(tok) not in _INT_RANGE:
                raise ln.error(f"integer literal {tok[:20]}... does not fit in int64")
            ln.pos = m.end()
            return int(tok)
        word = ln.match(_IDENT, "an argument").group(0)
        consts: dict[str, Arg] = {"True": True, "False": False, "None": None}
        if word in consts:
            return consts[word]
        if word.startswith("torch."):
            obj = getattr(torch, word[6:], None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise ln.error(f"unknown literal {word!r}")

    def op(self, ln: Cursor, mesh: Mesh | None) -> None:
        assert self.b is not None
        at = ln.position()
        names: list[re.Match[str]] = []
        if ln.peek("%"):
            names.append(ln.match(_NAME, "a result name"))
            while ln.peek(","):
                ln.take(",")
                names.append(ln.match(_NAME, "a result name"))
            ln.take("=")
        tname = ln.match(_IDENT, "an op name")
        try:
            target = resolve_target(tname.group(0))
        except ValueError as e:
            raise ln.error(str(e), tname.start()) from None
        ln.take("(")
        args: list[Arg] = []
        kwargs: list[tuple[str, Arg]] = []
        while not ln.peek(")"):
            m = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=").match(ln.text, ln.pos)
            if m is not None:
                ln.pos = m.end()
                kwargs.append((m.group(1), self.arg(ln)))
            elif kwargs:
                raise ln.error("positional argument after keyword argument")
            else:
                args.append(self.arg(ln))
            if not ln.peek(")"):
                ln.take(",")
        ln.take(")")
        results: list[Value] = []
        if names:
            ln.take(":")
            for i, name in enumerate(names):
                if i:
                    ln.take(",")
                t = self.type_(ln)
                results.append(Value(name.group(1), t, self.layout(ln, mesh)))
        prov = self.prov(ln, at)
        op = Op(
            target,
            tuple(freeze_arg(a) for a in args),
            tuple((k, freeze_arg(v)) for k, v in kwargs),
            tuple(results),
            prov,
        )
        self.b.append(op)
        for name, v in zip(names, results, strict=True):
            self.define(ln, name, v)

    def string(self, ln: Cursor, what: str) -> str:
        start = ln.pos
        tok = ln.match(_STRING, what + " (a double-quoted string closed on the same line)").group(0)
        try:
            return str(json.loads(tok))
        except json.JSONDecodeError as e:
            raise ln.error(f"bad string literal ({e.msg})", start + e.pos) from None

    def stack(self, ln: Cursor, name: str) -> ParamStack:
        """``[["a.weight", "b.weight"], ...]``: the model parameters behind each row of ``name``."""
        if _depth(ln.text[ln.pos :]) > 2:
            raise ln.error("a stack's members must be a JSON list of lists of names (nested too deep)")
        try:
            rows = json.loads(ln.text[ln.pos :])
        except json.JSONDecodeError as e:
            raise ln.error(f"a stack's members must be a JSON list of lists of names ({e.msg})") from None
        if not (
            isinstance(rows, list) and all(isinstance(r, list) and all(isinstance(m, str) for m in r) for r in rows)
        ):
            raise ln.error("a stack's members must be a JSON list of lists of names")
        ln.pos = len(ln.text)
        return ParamStack(name, tuple(tuple(r) for r in rows))

    def prov(self, ln: Cursor, at: TextPosition) -> Provenance:
        """The op's provenance comment (none: the default), with ``at``, where the op's line starts."""
        if ln.at_end():
            return TextProvenance(at=at) if self.located else Provenance()
        ln.take("#")
        parts = ln.text[ln.pos :].split(None, 2)
        ln.pos = len(ln.text)
        if len(parts) < 2 or parts[1] not in ("fwd", "bwd"):
            raise ln.error("provenance must read `# <module> fwd|bwd [@file:line]`")
        module = "" if parts[0] == "<root>" else parts[0]
        source = None
        if len(parts) == 3:
            if not parts[2].startswith("@"):
                raise ln.error("source location must start with @")
            source = parts[2][1:]
        kind = (lambda *a: TextProvenance(*a, at=at)) if self.located else Provenance
        return kind(module, parts[1], source)  # type: ignore[arg-type]

    def graph(self, text: str) -> Graph:
        lines = [(i + 1, raw.rstrip()) for i, raw in enumerate(text.splitlines())]
        lines = [(n, s) for n, s in lines if s.strip() and not s.lstrip().startswith("//")]
        if not lines:
            at = TextPosition(self.file, len(text.splitlines()) or 1, 1)
            raise error_at(at, "empty input: expected `graph @name {`")
        n0, head = lines[0]
        m = re.fullmatch(r"graph @([A-Za-z0-9_.\-]+)(?: (mesh<[^>]*>))? \{", head.strip())
        if m is None:
            raise Cursor(head, n0, self.file).error(f"expected `graph @name [mesh<...>] {{`, got {short(head.strip())}")
        mesh = self.mesh(Cursor(head, n0, self.file), m) if m.group(2) else None
        self.b = GraphBuilder(m.group(1), mesh)
        closed = False
        for lineno, s in lines[1:]:
            ln = Cursor(s, lineno, self.file)
            if closed:
                raise ln.error("text after the closing brace")
            word = s.split(None, 1)[0]
            if word == "}":
                ln.take("}")
                closed = True
            elif word in INPUT_KINDS:
                ln.take(word)
                nm = ln.match(_NAME, "an input name")
                ln.take(":")
                t = self.type_(ln)
                v = self.b.add_input(word, nm.group(1), t, self.layout(ln, mesh))  # type: ignore[arg-type]
                self.define(ln, nm, v)
                self.positions[v] = ln.position(0)
            elif word == "stack":
                ln.take("stack")
                name = ln.match(_NAME, "a stacked parameter's name").group(1)
                ln.take("=")
                self.b.stacks += (self.stack(ln, name),)
            elif word == "output":
                ln.take("output")
                kind = ln.match(_IDENT, "out or grad").group(0)
                if kind not in OUTPUT_KINDS:
                    raise ln.error(f"unknown output kind {kind!r}; expected one of {OUTPUT_KINDS}")
                ln.take("(")
                oname = ln.until_close("(", ")")
                ln.take("=")
                out = GraphOutput(kind, oname, self.value(ln))  # type: ignore[arg-type]
                self.b.add_output(out.kind, out.name, out.value)
                self.positions[out] = ln.position(0)
            else:
                self.op(ln, mesh)
            if not ln.at_end():
                raise ln.error("unexpected text at end of line")
        if not closed:
            last, s = lines[-1]
            raise error_at(TextPosition(self.file, last, len(s) + 1), "missing closing `}` at the end of the graph")
        g = self.b.build()
        return ParsedGraph(g.name, g.inputs, g.ops, g.outputs, g.mesh, g.stacks, self.positions)

    def mesh(self, ln: Cursor, m: re.Match[str]) -> Mesh:
        try:
            mesh = Mesh.parse(m.group(2))
        except ValueError as e:
            raise ln.error(f"bad mesh header: {e}", m.start(2)) from None
        if any(size > MAX_MESH_AXIS for size in mesh.sizes):
            raise ln.error(f"bad mesh header: {mesh} has an axis larger than {MAX_MESH_AXIS}", m.start(2))
        return mesh


def _split_top(body: str) -> list[tuple[int, str]]:
    """Split on commas that are not inside parentheses or brackets: (offset in ``body``, stripped part)."""
    parts: list[tuple[int, str]] = []
    depth, start = 0, 0
    for i, c in enumerate(body + ","):
        depth += (c in "([") - (c in ")]")
        if c == "," and (depth == 0 or i == len(body)):
            part = body[start:i]
            parts.append((start + len(part) - len(part.lstrip()), part.strip()))
            start = i + 1
    return parts


def _dim(ln: Cursor, text: str, pos: int) -> Dim:
    """One dimension at ``pos`` on the line: an int >= 0 or a symbolic size that is not negative."""
    try:
        d = parse_dim(text)
    except ValueError as e:
        raise ln.error(f"bad dimension: {e}", pos) from None
    if not isinstance(d, int):
        for p in d.atoms(sympy.Pow):
            if isinstance(p.exp, sympy.Integer) and abs(int(p.exp)) > MAX_DEGREE:
                raise ln.error(f"bad dimension: {short(text)} has a power of degree above {MAX_DEGREE}", pos)
    if (isinstance(d, int) and d < 0) or (not isinstance(d, int) and d.is_negative):
        raise ln.error(f"dimension {short(text)} is negative; sizes must be >= 0", pos)
    return d


def _check_numel(ln: Cursor, dims: list[Dim], pos: int) -> None:
    n = 1
    for d in dims:
        if isinstance(d, int):
            n *= d
            if n >= MAX_NUMEL:
                raise ln.error(
                    f"shape {[int(x) if isinstance(x, int) else str(x) for x in dims]} has 2**62 or more elements", pos
                )


def _depth(text: str) -> int:
    """Deepest ``[`` nesting in ``text`` (ignoring brackets inside strings)."""
    deepest = depth = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]]', text):
        depth += (m.group(0) == "[") - (m.group(0) == "]")
        deepest = max(deepest, depth)
    return deepest


def parse(text: str, file: str | None = None, *, positions: bool = True) -> Graph:
    """Parse one graph from its text form; ``str(parse(t)) == t`` for any printed graph. ``file``: the
    name errors give the text (``graph.ir:6:3: ...``); None: ``line 6, column 3: ...``. ``positions``
    False: ops keep no position (text no user reads, such as a program rank 0 sent)."""
    return _Parser(file, positions).graph(text)
