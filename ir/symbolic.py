"""Symbolic dimensions: sympy expressions, printed canonically and parsed without ``eval``."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import TypeAlias

import sympy

Dim: TypeAlias = int | sympy.Expr

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(\*\*|//|[-+*%(),]))")

# NOTE: a dimension is read, never evaluated without bounds: integer literals and every integer the
# arithmetic produces stay below 2**63, exponents are integer literals in [0, MAX_EXPONENT], and
# parentheses, calls and unary minus nest at most MAX_DEPTH deep (no RecursionError, no hang on
# ``9**9**9**9``). The printer never writes anything these bounds refuse.
MAX_INT = 2**63
MAX_EXPONENT = 64
MAX_DEPTH = 64


DEFAULT_HINT = 512
"""The size a symbol is priced at when nothing says otherwise (``size_hint``)."""

_HINTS: ContextVar[Mapping[str, int] | None] = ContextVar("meshfold_size_hints", default=None)


@contextlib.contextmanager
def size_hints(hints: Mapping[str, int]) -> Iterator[None]:
    """Price symbol ``name`` at ``hints[name]`` inside the block (the size it had when captured)."""
    token = _HINTS.set(dict(hints))
    try:
        yield
    finally:
        _HINTS.reset(token)


def size_hint(d: Dim) -> int:
    """``d`` as a number: itself when static, else evaluated at its symbols' hints. Passes price
    symbolic sizes (bytes, FLOPs) with it; nothing is ever allocated for a hinted size."""
    if isinstance(d, int):
        return d
    if d.is_Integer:
        return int(d)
    hints = _HINTS.get() or {}
    return int(d.subs({s: hints.get(str(s), DEFAULT_HINT) for s in d.free_symbols}))


def divides(size: Dim, ways: int) -> bool:
    """Whether ``ways`` ranks split ``size`` evenly, for every value of its symbols (``2*s0 - 2``
    over 2: yes; ``s0`` over 2: not provably, so no). A static size must also give every rank at
    least one row."""
    if isinstance(size, int):
        return size % ways == 0 and size >= ways
    return bool(sympy.Mod(size, ways) == 0)


def dim_str(d: Dim) -> str:
    """Deterministic text of a dimension (sympy's own ordering of terms)."""
    return str(d)


def _functions() -> dict[str, type[sympy.Function]]:
    from torch.utils._sympy import functions as F

    table: dict[str, type[sympy.Function]] = {"Max": sympy.Max, "Min": sympy.Min}
    for name in ("FloorDiv", "CeilDiv", "CleanDiv", "Mod", "PythonMod", "ModularIndexing"):
        fn = getattr(F, name, None)
        if fn is not None:
            table[name] = fn
    return table


def parse_dim(text: str) -> Dim:
    """Parse an integer or a sympy expression over symbols (``+ - * // % **``, whitelisted calls).

    Raises ``ValueError`` naming what is wrong for anything else, including the bounds above."""
    tokens = _tokenize(text)
    parser = _ExprParser(tokens, text)
    expr = parser.expr()
    if parser.pos != len(tokens):
        raise ValueError(f"unexpected {tokens[parser.pos]!r} in dimension {_short(text)}")
    if isinstance(expr, sympy.Integer):
        return int(expr)
    result: sympy.Expr = expr
    return result


def _tokenize(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"cannot read dimension {_short(text)} at {text[pos:].lstrip()[:1]!r}")
        out.append(m.group(m.lastindex or 0))
        pos = m.end()
    return out


class _ExprParser:
    """Recursive descent over + - (lowest), * // % , unary -, ** , atoms."""

    def __init__(self, tokens: list[str], text: str) -> None:
        self.tokens, self.text, self.pos, self.depth = tokens, text, 0, 0

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ValueError(f"dimension {_short(self.text)} nests deeper than {MAX_DEPTH} levels")

    def bounded(self, e: sympy.Expr) -> sympy.Expr:
        if isinstance(e, sympy.Integer) and abs(int(e)) >= MAX_INT:
            raise ValueError(f"dimension {_short(self.text)} has an integer of magnitude >= 2**63")
        return e

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, tok: str | None = None) -> str:
        t = self.peek()
        if t is None or (tok is not None and t != tok):
            raise ValueError(f"expected {tok or 'a term'} in dimension {_short(self.text)}")
        self.pos += 1
        return t

    def expr(self) -> sympy.Expr:
        left = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            right = self.term()
            left = self.bounded(left + right if op == "+" else left - right)
        return left

    def term(self) -> sympy.Expr:
        left = self.unary()
        while self.peek() in ("*", "//", "%"):
            op = self.take()
            right = self.unary()
            if op == "*":
                left = self.bounded(left * right)
            else:
                left = self.call("FloorDiv" if op == "//" else "Mod", [left, right])
        return left

    def call(self, name: str, args: list[sympy.Expr]) -> sympy.Expr:
        fns = _functions()
        if name not in fns:
            raise ValueError(f"unknown function {name!r} in dimension {_short(self.text)}; known: {sorted(fns)}")
        try:
            result: sympy.Expr = fns[name](*args)
        except (TypeError, ValueError, ArithmeticError) as e:
            raise ValueError(f"{name} cannot take these arguments in dimension {_short(self.text)} ({e})") from None
        return self.bounded(result)

    def unary(self) -> sympy.Expr:
        if self.peek() == "-":
            self.take()
            self.nest()
            inner = -self.unary()
            self.depth -= 1
            return inner
        base = self.atom()
        if self.peek() == "**":
            self.take()
            exp = self.take()
            if not exp.isdigit() or len(exp) > 3 or int(exp) > MAX_EXPONENT:
                raise ValueError(
                    f"exponent {exp!r} in dimension {_short(self.text)} must be an integer literal 0..{MAX_EXPONENT}"
                )
            if self.peek() == "**":
                raise ValueError(f"chained exponents in dimension {_short(self.text)} are not allowed")
            return self.bounded(sympy.Pow(base, sympy.Integer(int(exp))))
        return base

    def atom(self) -> sympy.Expr:
        tok = self.take()
        if tok.isdigit():
            if len(tok) > 19:
                raise ValueError(f"integer {_short(tok)} in dimension {_short(self.text)} is too large (>= 2**63)")
            return self.bounded(sympy.Integer(int(tok)))
        if tok == "(":
            self.nest()
            inner = self.expr()
            self.take(")")
            self.depth -= 1
            return inner
        if tok[0].isalpha() or tok[0] == "_":
            if self.peek() == "(":
                self.take("(")
                self.nest()
                args = [self.expr()]
                while self.peek() == ",":
                    self.take()
                    args.append(self.expr())
                self.take(")")
                self.depth -= 1
                return self.call(tok, args)
            return sympy.Symbol(tok, integer=True, positive=True)
        raise ValueError(f"unexpected {tok!r} in dimension {_short(self.text)}")


def _short(text: str) -> str:
    """``text`` quoted, cut to 40 characters so an error stays one short line."""
    return repr(text if len(text) <= 40 else text[:37] + "...")
