"""The pass contract: a frozen dataclass with a kebab-case ``name``, typed options and ``apply``."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from meshfold.ir import Graph
    from meshfold.passes.context import PassContext

# NOTE: graph properties passes require and ensure. ``joint`` holds for a fresh capture.
JOINT = "joint"
CLEAN = "clean"
VERIFIED = "verified"


def quiet(message: str) -> AbstractContextManager[object]:
    """A ``PassContext.status`` that shows nothing."""
    return nullcontext()


class PassError(ValueError):
    """A pass cannot run: bad options, a pipeline in the wrong order, or a graph it cannot handle."""


class PassFailure(PassError):
    """A pass raised while running; names the pass and its position (the original error is the cause)."""

    def __init__(self, index: int, spelling: str, cause: Exception) -> None:
        super().__init__(f"pass {index + 1} ({spelling}) failed: {type(cause).__name__}: {cause}")
        self.index = index
        self.spelling = spelling


@dataclass(frozen=True)
class Pass:
    """Base of every pass. Subclasses are frozen dataclasses whose fields are the pass options.

    ``requires``: properties that must hold before the pass; ``ensures``: properties it establishes;
    ``invalidates``: properties that no longer hold after it (``"*"`` means all but ``ensures``).
    """

    name: ClassVar[str]
    requires: ClassVar[frozenset[str]] = frozenset()
    ensures: ClassVar[frozenset[str]] = frozenset()
    invalidates: ClassVar[frozenset[str]] = frozenset({"*"})

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        """Return the rewritten graph; ``graph`` itself is never modified."""
        raise NotImplementedError

    def properties_after(self, before: frozenset[str]) -> frozenset[str]:
        kept = frozenset() if "*" in self.invalidates else before - self.invalidates
        return kept | self.ensures


def key_values(text: str, what: str, example: str) -> dict[str, object]:
    """``ep=4,etp=1`` as ``{"ep": 4, "etp": 1}`` (an int, float or boolean where the value spells
    one): how the shell writes a mapping option (``moe``, ``pp``); ``what`` names it in errors."""
    spec: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip() or not raw.strip():
            raise PassError(f"{what} {text!r}: write key=value pairs, e.g. {example}")
        spec[key.strip()] = _value(raw.strip())
    if not spec:
        raise PassError(f"{what} {text!r} is empty; e.g. {example}")
    return spec


def _value(raw: str) -> object:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)
