"""Symbolic dimensions: sympy expressions, printed canonically and parsed without ``eval``."""

from __future__ import annotations

import re
from typing import TypeAlias

import sympy

Dim: TypeAlias = int | sympy.Expr

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(\*\*|//|[-+*%(),]))")


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
    """Parse an integer or a sympy expression over symbols (``+ - * // % **``, whitelisted calls)."""
    tokens = _tokenize(text)
    parser = _ExprParser(tokens, text)
    expr = parser.expr()
    if parser.pos != len(tokens):
        raise ValueError(f"unexpected {tokens[parser.pos]!r} in dimension {text!r}")
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
            raise ValueError(f"cannot read dimension {text!r} at column {pos}")
        out.append(m.group(m.lastindex or 0))
        pos = m.end()
    return out


class _ExprParser:
    """Recursive descent over + - (lowest), * // % , unary -, ** , atoms."""

    def __init__(self, tokens: list[str], text: str) -> None:
        self.tokens, self.text, self.pos = tokens, text, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, tok: str | None = None) -> str:
        t = self.peek()
        if t is None or (tok is not None and t != tok):
            raise ValueError(f"expected {tok or 'a term'} in dimension {self.text!r}")
        self.pos += 1
        return t

    def expr(self) -> sympy.Expr:
        left = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            right = self.term()
            left = left + right if op == "+" else left - right
        return left

    def term(self) -> sympy.Expr:
        left = self.unary()
        while self.peek() in ("*", "//", "%"):
            op = self.take()
            right = self.unary()
            if op == "*":
                left = left * right
            else:
                fn = _functions()["FloorDiv" if op == "//" else "Mod"]
                left = fn(left, right)
        return left

    def unary(self) -> sympy.Expr:
        if self.peek() == "-":
            self.take()
            return -self.unary()
        base = self.atom()
        if self.peek() == "**":
            self.take()
            return sympy.Pow(base, self.unary())
        return base

    def atom(self) -> sympy.Expr:
        tok = self.take()
        if tok.isdigit():
            return sympy.Integer(int(tok))
        if tok == "(":
            inner = self.expr()
            self.take(")")
            return inner
        if tok[0].isalpha() or tok[0] == "_":
            if self.peek() == "(":
                fns = _functions()
                if tok not in fns:
                    raise ValueError(f"unknown function {tok!r} in dimension {self.text!r}; known: {sorted(fns)}")
                self.take("(")
                args = [self.expr()]
                while self.peek() == ",":
                    self.take()
                    args.append(self.expr())
                self.take(")")
                return fns[tok](*args)
            return sympy.Symbol(tok, integer=True, positive=True)
        raise ValueError(f"unexpected {tok!r} in dimension {self.text!r}")
