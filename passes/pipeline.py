"""Pipelines written as strings, ``"cleanup{cse=false},verify"``, checked before anything runs."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

from meshfold.ir import Graph
from meshfold.passes.base import JOINT, Pass, PassError, PassFailure
from meshfold.passes.registry import default_registry

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

Callback = Callable[[int, Pass, Graph], None]
"""Called as ``callback(index, pass_, graph_after)`` after each pass."""

_ITEM = re.compile(r"\s*([a-z][a-z0-9-]*)\s*(\{[^{}]*\})?\s*(,|$)")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?$")
_UNITS = {
    None: 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}


def parse_size(text: str) -> int:
    """``"60GiB"`` → bytes."""
    m = _SIZE.match(text.strip())
    if m is None:
        raise PassError(f"{text!r} is not a size; write e.g. 60GiB or 1024")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class PassTiming:
    """Wall time of one pass (kept out of every dump)."""

    name: str
    seconds: float


@dataclass(frozen=True)
class PassPipeline:
    """An ordered list of configured passes."""

    passes: tuple[Pass, ...]

    @staticmethod
    def parse(text: str, registry: dict[str, type[Pass]] | None = None) -> PassPipeline:
        """Build a pipeline from ``"name{opt=value other=value},name"``; unknown names/options raise."""
        reg = registry if registry is not None else default_registry()
        passes: list[Pass] = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            m = _ITEM.match(text, pos)
            if m is None or m.end() == pos:
                raise PassError(f"cannot read pipeline {text!r} at column {pos + 1}; write e.g. cleanup,verify")
            passes.append(_make_pass(m.group(1), m.group(2), reg))
            pos = m.end()
        if not passes:
            raise PassError("empty pipeline; write e.g. cleanup,verify")
        return PassPipeline(tuple(passes))

    def __str__(self) -> str:
        return ",".join(pass_spelling(p) for p in self.passes)

    def check(self, initial: frozenset[str] = frozenset({JOINT})) -> None:
        """Raise if some pass runs before the properties it requires hold."""
        have = initial
        for i, p in enumerate(self.passes):
            missing = p.requires - have
            if missing:
                raise PassError(
                    f"pass {i + 1} ({p.name}) requires {sorted(missing)}, which no earlier pass ensures; "
                    f"pipeline: {self}"
                )
            have = p.properties_after(have)

    def run(
        self,
        ctx: PassContext,
        graph: Graph,
        callback: Callback | None = None,
        initial: frozenset[str] = frozenset({JOINT}),
    ) -> tuple[Graph, list[PassTiming]]:
        """Check the order, then apply every pass; return the final graph and per-pass times."""
        self.check(initial)
        timings: list[PassTiming] = []
        n = len(self.passes)
        with long_lived_heap() as settle:
            for i, p in enumerate(self.passes):
                start = time.perf_counter()
                try:
                    with ctx.status(f"pass {i + 1} of {n}: {pass_spelling(p)}"):
                        graph = p.apply(ctx, graph)
                except Exception as e:
                    raise PassFailure(i, pass_spelling(p), e) from e
                timings.append(PassTiming(p.name, time.perf_counter() - start))
                settle()
                if callback is not None:
                    callback(i, p, graph)
        return graph, timings


@contextlib.contextmanager
def long_lived_heap() -> Iterator[Callable[[], None]]:
    """Within: the objects alive on entry (torch, the model, the input graph) are left out of the
    cyclic collector's scans, which otherwise walk them again and again while a pass builds a
    graph of a hundred thousand small objects (at 80 layers a third of the pipeline's time went
    there). Objects made inside are collected as usual; the rest return to the collector on exit.
    Yields ``settle``: leaves what is alive now out of the scans too (the graph a pass returned,
    which every later pass reads). A no-op inside another one, or where the program froze or
    switched off the collector itself."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield lambda: None
        return
    gc.freeze()
    try:
        yield gc.freeze
    finally:
        gc.unfreeze()


def pass_spelling(p: Pass) -> str:
    """``name{opt=value}`` listing options that differ from their defaults."""
    opts = []
    for f in dataclasses.fields(p):
        value = getattr(p, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        opts.append(f"{f.name.replace('_', '-')}={text}")
    return p.name + ("{" + " ".join(opts) + "}" if opts else "")


def _make_pass(name: str, options: str | None, reg: dict[str, type[Pass]]) -> Pass:
    if name not in reg:
        raise PassError(f"unknown pass {name!r}; known passes: {', '.join(sorted(reg))}")
    cls = reg[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    body = options[1:-1] if options else ""
    for item in filter(None, re.split(r"[\s,]+", body.strip())):
        key, sep, raw = item.partition("=")
        field = key.replace("-", "_")
        if not sep or field not in fields:
            known = ", ".join(k.replace("_", "-") for k in fields) or "none"
            raise PassError(f"pass {name!r} has no option {key!r}; its options: {known}")
        kwargs[field] = _convert(name, key, raw, hints[field])
    return cls(**kwargs)


def _convert(pass_name: str, key: str, raw: str, hint: Any) -> Any:
    where = f"option {key} of pass {pass_name!r}"
    if hint is bool:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise PassError(f"{where} takes true or false, not {raw!r}")
        return raw.lower() in ("true", "1")
    if hint is int:
        if raw.isdigit():
            return int(raw)
        if _SIZE.match(raw):
            return parse_size(raw)
        raise PassError(f"{where} takes an integer or a size like 60GiB, not {raw!r}")
    if hint is float:
        try:
            return float(raw)
        except ValueError:
            raise PassError(f"{where} takes a number, not {raw!r}") from None
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        if raw not in choices:
            raise PassError(f"{where} takes one of {', '.join(map(str, choices))}, not {raw!r}")
        return raw
    return raw


def parse_pipeline(text: str | Sequence[Pass]) -> PassPipeline:
    """A pipeline from a string or an already-built sequence of passes."""
    return PassPipeline.parse(text) if isinstance(text, str) else PassPipeline(tuple(text))
