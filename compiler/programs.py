"""The programs one ``ParallelModule`` holds: one per call signature, in a bounded cache.

The first program is compiled for the example inputs; a call with another signature (the last,
smaller batch; an evaluation at another length; ``pm.eval()``; ``torch.no_grad()``) compiles
another, on every rank alike (``meshfold.signature.agree`` has made every rank agree on the
signature first). All programs share the module's parameters, so each must keep every parameter in
the layout the first chose. A signature that cannot be compiled (a batch the data-parallel ranks do
not divide) is remembered with its error, so it is refused again without compiling.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshfold import ir
from meshfold.backends.eager import Lowered, RankContext
from meshfold.signature import CallMismatch, Signature

log = logging.getLogger("meshfold")

DEFAULT_CACHE = 8
"""Programs a module keeps by default (``parallelize(..., cache_size=)``)."""


@dataclass
class Program:
    """One compiled program and what calling it needs."""

    signature: Signature
    graph: ir.Graph
    lowered: Lowered
    verify_with: tuple[Lowered, RankContext] | None = None
    calls: int = 0
    structure: tuple[Any, list[Any]] | None = None
    """The model's output pytree for this signature (``tracer.output_structure``), learned on the
    first call; None: the flat outputs."""
    structure_known: bool = False
    kinds: dict[str, str] = field(init=False)
    input_layouts: list[ir.Layout] = field(init=False)
    grad_sources: dict[str, set[str]] = field(init=False)
    output_is_tuple: bool = field(init=False)

    def __post_init__(self) -> None:
        layouts = {i.name: i.value.layout for i in self.graph.inputs}
        self.kinds = {i.name: i.kind for i in self.graph.inputs}
        self.input_layouts = [layouts[n] for n in self.lowered.fwd_inputs]
        self.grad_sources = grad_sources(self.graph)
        self.output_is_tuple = sum(1 for o in self.graph.outputs if o.kind == "out") > 1

    def state_layouts(self) -> dict[str, ir.Layout]:
        """Each parameter's and buffer's layout in this program."""
        return {i.name: i.value.layout for i in self.graph.inputs if i.kind in ("param", "buffer")}


Compile = Callable[[Sequence[Any], Signature], Program]
"""Compiles the model for one call on every rank (collective); raises on every rank alike."""


class Programs:
    """The bounded cache of a module's programs, least recently used first out."""

    def __init__(self, first: Program, compile: Compile, size: int = DEFAULT_CACHE, names: Sequence[str] = ()) -> None:
        if size < 1:
            raise ValueError(f"cache_size must be at least 1, not {size}")
        self.first = first
        self.names = tuple(names)
        """The model's forward argument names, for messages."""
        self.size = size
        self._compile = compile
        self._held: OrderedDict[Signature, Program | str] = OrderedDict([(first.signature, first)])
        self.compiled = 1
        self.evicted = 0

    def get(self, inputs: Sequence[Any], sig: Signature) -> Program:
        """The program for ``sig``, compiling it when none is held; raises ``CallMismatch`` (on every
        rank, as every rank holds the same programs) when ``sig`` cannot be compiled."""
        held = self._held.get(sig)
        if held is None:
            held = self._new(inputs, sig)
        self._held.move_to_end(sig)
        if isinstance(held, str):
            raise CallMismatch(held)
        held.calls += 1
        return held

    def _new(self, inputs: Sequence[Any], sig: Signature) -> Program | str:
        names = self.names
        differs = sig.difference(self.first.signature, names)
        log.info("meshfold: compiling a program for %s (%s)", sig.describe(names), differs)
        try:
            held: Program | str = self._compile(inputs, sig)
        except Exception as e:
            held = f"{differs}, and no program can be compiled for this call: {e}. {_advice(differs)}"
        else:
            self.compiled += 1
            fixed = self.first.state_layouts()
            moved = [n for n, lay in held.state_layouts().items() if fixed.get(n, lay) != lay]
            if moved:
                held = (
                    f"{differs}; the program compiled for it lays out {moved[0]} as {held.state_layouts()[moved[0]]}, "
                    f"but the module holds it as {fixed[moved[0]]}; give a plan that fixes the layouts "
                    "(a preset such as 'fsdp+tp') or call with the example inputs' sizes"
                )
        if len(self._held) >= self.size:
            old, _ = self._held.popitem(last=False)
            self.evicted += 1
            warnings.warn(
                f"meshfold: this module holds {self.size} compiled programs (cache_size); dropped the one for "
                f"{old.describe(names)}. Calls that vary in shape recompile each time: keep shapes fixed "
                "(pad the last batch), or raise cache_size",
                stacklevel=4,
            )
        self._held[sig] = held
        return held

    def report(self) -> list[tuple[str, int]]:
        """(signature, calls) of every program held, least recently used first; refused signatures
        show ``-1`` calls."""
        names = self.names
        return [(s.describe(names), p.calls if isinstance(p, Program) else -1) for s, p in self._held.items()]


def _advice(differs: str) -> str:
    """What to do about a call no program can run, by what differs in it."""
    if "has shape" in differs:
        return "Call it with sizes the plan can split (pad or drop a last, smaller batch)"
    if " is " in differs and "the program was compiled for" in differs:
        return "Convert the input to the dtype the model takes, as one device would need too"
    return "Call it as the example inputs were given"


def grad_sources(graph: ir.Graph) -> dict[str, set[str]]:
    """Each gradient output's name → the tangent inputs (``tangent.<i>``) it is computed from."""
    deps: dict[ir.Value, set[str]] = {i.value: {i.name} for i in graph.inputs if i.kind == "tangent"}

    def of(arg: Any) -> set[str]:
        if isinstance(arg, ir.Value):
            return deps.get(arg, set())
        if isinstance(arg, tuple):
            return set().union(*map(of, arg))
        return set()

    for op in graph.ops:
        found = of(op.args) | of(tuple(v for _, v in op.kwargs))
        if found:
            for r in op.results:
                deps[r] = found
    return {o.name: deps.get(o.value, set()) for o in graph.outputs if o.kind == "grad"}
