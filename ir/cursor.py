"""A cursor over one line of IR text, and the parser's one-line :class:`ParseError`."""

from __future__ import annotations

import re

from meshfold.ir.graph import TextPosition


class ParseError(ValueError):
    """Bad IR text; the one-line message reads ``<file>:L:C: <what is wrong>`` (``TextPosition``), or
    ``line L, column C: <what is wrong>`` for text without a file name."""


class Cursor:
    """A cursor over one line of text without its indentation (``text``, ``pos``); positions it
    reports count columns from the start of the raw line, as editors do."""

    def __init__(self, raw: str, lineno: int, file: str | None = None) -> None:
        self.text, self.pos, self.lineno, self.file = raw.strip(), 0, lineno, file
        self.indent = len(raw) - len(raw.lstrip())

    def position(self, pos: int | None = None) -> TextPosition:
        """The position of ``pos`` in ``text`` (default: the cursor's)."""
        return TextPosition(self.file, self.lineno, self.indent + (self.pos if pos is None else pos) + 1)

    def error(self, what: str, pos: int | None = None) -> ParseError:
        return error_at(self.position(pos), what)

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


def short(text: str) -> str:
    """``text`` quoted and cut to 60 characters so a message stays one short line."""
    return repr(text if len(text) <= 60 else text[:57] + "...")


def error_at(at: TextPosition, what: str) -> ParseError:
    """The error for ``what`` at ``at`` (whitespace folded so it stays one line)."""
    return ParseError(f"{at}: {' '.join(what.split())}")
