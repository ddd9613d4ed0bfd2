"""Reads the text form written by :mod:`ir.printer`. Never evaluates code: every literal has a
fixed spelling and op names resolve by attribute lookup on ``torch.ops``."""

from __future__ import annotations

import json
import re

import torch

from meshfold.ir.graph import INPUT_KINDS, OUTPUT_KINDS, Arg, Graph, GraphBuilder, ParamStack, Provenance, Value
from meshfold.ir.mesh import Mesh
from meshfold.ir.ops import resolve_target
from meshfold.ir.placement import Layout, Placement, R, parse_placement
from meshfold.ir.symbolic import parse_dim
from meshfold.ir.types import DTYPES_BY_NAME, ScalarType, TensorType, Type

_NAME = re.compile(r"%([A-Za-z0-9_.]+)")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_NUMBER = re.compile(r"-?(?:inf|nan|\d+(?:\.\d*)?(?:e[+-]?\d+)?)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


class ParseError(ValueError):
    """Bad IR text; the message names the line and column."""


class _Line:
    """A cursor over one line of text."""

    def __init__(self, text: str, lineno: int) -> None:
        self.text, self.pos, self.lineno = text, 0, lineno

    def error(self, what: str) -> ParseError:
        return ParseError(f"line {self.lineno}, column {self.pos + 1}: {what}\n  {self.text}")

    def ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] == " ":
            self.pos += 1

    def peek(self, s: str) -> bool:
        self.ws()
        return self.text.startswith(s, self.pos)

    def take(self, s: str) -> None:
        if not self.peek(s):
            raise self.error(f"expected {s!r}")
        self.pos += len(s)

    def match(self, pattern: re.Pattern[str], what: str) -> re.Match[str]:
        self.ws()
        m = pattern.match(self.text, self.pos)
        if m is None:
            raise self.error(f"expected {what}")
        self.pos = m.end()
        return m

    def until_close(self, open_: str, close: str) -> str:
        """Text up to the bracket closing one already taken (nesting respected)."""
        depth, start = 1, self.pos
        while self.pos < len(self.text):
            c = self.text[self.pos]
            depth += (c == open_) - (c == close)
            if depth == 0:
                self.pos += 1
                return self.text[start : self.pos - 1]
            self.pos += 1
        raise self.error(f"missing {close!r}")

    def at_end(self) -> bool:
        self.ws()
        return self.pos >= len(self.text)


class _Parser:
    def __init__(self) -> None:
        self.values: dict[str, Value] = {}
        self.b: GraphBuilder | None = None

    def value(self, ln: _Line) -> Value:
        name = ln.match(_NAME, "a value like %x").group(1)
        if name not in self.values:
            raise ln.error(f"%{name} is used before it is defined")
        return self.values[name]

    def define(self, ln: _Line, name: str, v: Value) -> None:
        if name in self.values:
            raise ln.error(f"%{name} is defined twice")
        self.values[name] = v

    def type_(self, ln: _Line) -> Type:
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
        body = ln.until_close("[", "]")
        dims = tuple(parse_dim(d) for d in _split_top(body)) if body.strip() else ()
        return TensorType(dims, DTYPES_BY_NAME[dt])

    def layout(self, ln: _Line, mesh: Mesh | None) -> Layout:
        if not ln.peek("{"):
            return Layout.replicated(mesh)
        ln.take("{")
        body = ln.until_close("{", "}")
        given: dict[str, Placement] = {}
        for item in _split_top(body) if body.strip() else []:
            axis, sep, pl = item.partition(":")
            if not sep:
                raise ln.error(f"layout entry {item!r} must look like axis: S(0)")
            given[axis.strip()] = parse_placement(pl)
        if mesh is None:
            if given:
                raise ln.error("a layout needs a mesh; write `graph @name mesh<dp=2> {`")
            return Layout()
        unknown = set(given) - set(mesh.names)
        if unknown:
            raise ln.error(f"layout names axes {sorted(unknown)} that {mesh} lacks")
        return Layout(mesh.names, tuple(given.get(n, R) for n in mesh.names))

    def arg(self, ln: _Line) -> Arg:
        ln.ws()
        if ln.peek("%"):
            return self.value(ln)
        if ln.peek("["):
            ln.take("[")
            items: list[Arg] = []
            while not ln.peek("]"):
                items.append(self.arg(ln))
                if not ln.peek("]"):
                    ln.take(",")
            ln.take("]")
            return tuple(items)
        if ln.peek('"'):
            return str(json.loads(ln.match(_STRING, "a string").group(0)))
        if ln.peek("sym("):
            ln.take("sym(")
            return parse_dim(ln.until_close("(", ")"))
        if ln.peek("device("):
            ln.take("device(")
            s = json.loads(ln.match(_STRING, "a device string").group(0))
            ln.take(")")
            return torch.device(s)
        m = _NUMBER.match(ln.text, ln.pos)
        if m is not None and not _IDENT.match(ln.text, m.end()):
            ln.pos = m.end()
            tok = m.group(0)
            is_float = any(c in tok for c in ".en") or "inf" in tok
            return float(tok) if is_float else int(tok)
        word = ln.match(_IDENT, "an argument").group(0)
        consts: dict[str, Arg] = {"True": True, "False": False, "None": None}
        if word in consts:
            return consts[word]
        if word.startswith("torch."):
            obj = getattr(torch, word[6:], None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise ln.error(f"unknown literal {word!r}")

    def op(self, ln: _Line, mesh: Mesh | None) -> None:
        assert self.b is not None
        names: list[str] = []
        if ln.peek("%"):
            names.append(ln.match(_NAME, "a result name").group(1))
            while ln.peek(","):
                ln.take(",")
                names.append(ln.match(_NAME, "a result name").group(1))
            ln.take("=")
        tname = ln.match(_IDENT, "an op name").group(0)
        try:
            target = resolve_target(tname)
        except ValueError as e:
            raise ln.error(str(e)) from None
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
                results.append(Value(name, t, self.layout(ln, mesh)))
        prov = self.prov(ln)
        self.b.add_op(target, args, kwargs, results, prov)
        for name, v in zip(names, results, strict=True):
            self.define(ln, name, v)

    def stack(self, ln: _Line, name: str) -> ParamStack:
        """``[["a.weight", "b.weight"], ...]``: the model parameters behind each row of ``name``."""
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

    def prov(self, ln: _Line) -> Provenance:
        if ln.at_end():
            return Provenance()
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
        return Provenance(module, parts[1], source)  # type: ignore[arg-type]

    def graph(self, text: str) -> Graph:
        lines = [(i + 1, raw.rstrip()) for i, raw in enumerate(text.splitlines())]
        lines = [(n, s) for n, s in lines if s.strip() and not s.lstrip().startswith("//")]
        if not lines:
            raise ParseError("empty input: expected `graph @name {`")
        n0, head = lines[0]
        m = re.fullmatch(r"graph @([A-Za-z0-9_.\-]+)(?: (mesh<[^>]*>))? \{", head.strip())
        if m is None:
            raise ParseError(f"line {n0}: expected `graph @name [mesh<...>] {{`, got {head.strip()!r}")
        mesh = Mesh.parse(m.group(2)) if m.group(2) else None
        self.b = GraphBuilder(m.group(1), mesh)
        closed = False
        for lineno, s in lines[1:]:
            if closed:
                raise ParseError(f"line {lineno}: text after the closing brace")
            ln = _Line(s.strip(), lineno)
            word = s.split(None, 1)[0]
            if word == "}":
                ln.take("}")
                closed = True
            elif word in INPUT_KINDS:
                ln.take(word)
                name = ln.match(_NAME, "an input name").group(1)
                ln.take(":")
                t = self.type_(ln)
                v = self.b.add_input(word, name, t, self.layout(ln, mesh))  # type: ignore[arg-type]
                self.define(ln, name, v)
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
                self.b.add_output(kind, oname, self.value(ln))  # type: ignore[arg-type]
            else:
                self.op(ln, mesh)
            if not ln.at_end():
                raise ln.error("unexpected text at end of line")
        if not closed:
            raise ParseError("missing closing `}`")
        return self.b.build()


def _split_top(body: str) -> list[str]:
    """Split on commas that are not inside parentheses or brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(body):
        depth += (c in "([") - (c in ")]")
        if c == "," and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    return parts


def parse(text: str) -> Graph:
    """Parse one graph from its text form; ``str(parse(t)) == t`` for any printed graph."""
    return _Parser().graph(text)
