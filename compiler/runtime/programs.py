"""The programs one ``ParallelModule`` holds: one per call signature, in a bounded cache.

The first program is compiled for the example inputs; a call with another signature (the last,
smaller batch; an evaluation at another length; ``pm.eval()``; ``torch.no_grad()``) compiles
another, on every rank alike (``meshfold.runtime.signature.agree`` has made every rank agree on the
signature first). All programs share the module's parameters, so each must keep every parameter in
the layout the first chose. A signature that cannot be compiled (a batch the data-parallel ranks do
not divide) is remembered with its error, so it is refused again without compiling.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import sympy

from meshfold import ir
from meshfold.backends.eager import Lowered, RankContext
from meshfold.passes.options import DEFAULT_CACHE
from meshfold.runtime.signature import CallMismatch, Signature

log = logging.getLogger("meshfold")

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
    report: tuple[str, ...] = ()
    """The sharding solve of the compile that made this program (``solve_report``), when it solved."""
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


class Compiler(Protocol):
    """How a module gets new programs."""

    def compile(
        self, inputs: Sequence[Any], sig: Signature, dynamic: tuple[tuple[int, int], ...]
    ) -> tuple[ir.Graph, tuple[sympy.Basic, ...]]:
        """The planned graph for a call like ``inputs`` (``dynamic`` dims symbolic) and its guards,
        on every rank (collective); raises on every rank alike."""
        ...

    def lower(self, graph: ir.Graph, sig: Signature) -> Program:
        """This rank's program for a static ``graph`` (no collective)."""
        ...


@dataclass
class Template:
    """A program for every value of some symbolic sizes (a sequence length): one planned graph;
    each call's sizes are substituted into it (``ir.specialize``) and lowered, without a capture
    or a sharding solve."""

    signature: Signature
    graph: ir.Graph
    guards: tuple[sympy.Basic, ...]
    specialized: int = 0

    def binding(self, sig: Signature) -> dict[str, int] | None:
        """Each symbol's value for a call of ``sig``, when the template covers it: the same call but
        for the symbolic sizes, and every guard holds for them."""
        base = self.signature
        same_mode = (sig.training, sig.grad, sig.autocast) == (base.training, base.grad, base.autocast)
        if not same_mode or len(sig.inputs) != len(base.inputs):
            return None
        user = iter(i.value.type for i in self.graph.inputs if i.kind == "input")
        found: dict[str, int] = {}
        for spec, was in zip(sig.inputs, base.inputs, strict=True):
            if spec[0] != "tensor" or was[0] != "tensor":
                if spec != was:
                    return None
                continue
            t = next(user)
            if spec[2:] != was[2:] or not isinstance(t, ir.TensorType) or len(spec[1]) != t.rank:
                return None
            for got, want in zip(spec[1], t.shape, strict=True):
                if isinstance(want, sympy.Symbol):
                    if found.setdefault(str(want), got) != got:
                        return None
                elif want != got:
                    return None
        subs = {sympy.Symbol(n, integer=True, positive=True): v for n, v in found.items()}
        for guard in self.guards:
            held = guard.subs(subs)
            if held is not sympy.true and held is not True:
                return None
        return found


class Programs:
    """The bounded cache of a module's programs, least recently used first out, and the symbolic
    templates that make programs for new sequence lengths without compiling."""

    def __init__(
        self, first: Program, compiler: Compiler, size: int = DEFAULT_CACHE, names: Sequence[str] = ()
    ) -> None:
        if size < 1:
            raise ValueError(f"cache_size must be at least 1, not {size}")
        self.first = first
        self.names = tuple(names)
        """The model's forward argument names, for messages."""
        self.size = size
        self._compiler = compiler
        self._held: OrderedDict[Signature, Program | str] = OrderedDict([(first.signature, first)])
        self.templates: list[Template] = []
        self.compiled = 1
        self.evicted = 0

    def get(self, inputs: Sequence[Any], sig: Signature) -> Program:
        """The program for ``sig``: held, made from a template, or compiled; raises ``CallMismatch``
        (on every rank, as every rank holds the same programs) when ``sig`` cannot be compiled."""
        held = self._held.get(sig)
        if held is None:
            held = self._specialized(sig) or self._new(inputs, sig)
            self._hold(sig, held)
        self._held.move_to_end(sig)
        if isinstance(held, str):
            raise CallMismatch(held)
        held.calls += 1
        return held

    def _specialized(self, sig: Signature) -> Program | None:
        for template in self.templates:
            found = template.binding(sig)
            if found is not None:
                template.specialized += 1
                return self._compiler.lower(ir.specialize(template.graph, found), sig)
        return None

    def _new(self, inputs: Sequence[Any], sig: Signature) -> Program | str:
        names = self.names
        differs = sig.difference(self.first.signature, names)
        dynamic = self._varying(sig)
        log.info("meshfold: compiling a program for %s (%s)", sig.describe(names), differs)
        try:
            if dynamic:
                try:
                    graph, guards = self._compiler.compile(inputs, sig, dynamic)
                    self.templates.append(Template(sig, graph, guards))
                    program = self._specialized(sig)
                    assert program is not None, "a template covers the call it was compiled for"
                    held: Program | str = program
                except Exception as e:
                    # NOTE: a model whose sizes cannot stay symbolic (a guard fixes them) compiles per size
                    log.info(
                        "meshfold: no symbolic program for %s (%s); compiling for its sizes", sig.describe(names), e
                    )
                    dynamic = ()
            if not dynamic:
                graph, _ = self._compiler.compile(inputs, sig, ())
                held = self._compiler.lower(graph, sig)
        except Exception as e:
            return f"{differs}, and no program can be compiled for this call: {e}. {_advice(differs)}"
        self.compiled += 1
        fixed = self.first.state_layouts()
        moved = [n for n, lay in held.state_layouts().items() if fixed.get(n, lay) != lay]
        if moved:
            return (
                f"{differs}; the program compiled for it lays out {moved[0]} as {held.state_layouts()[moved[0]]}, "
                f"but the module holds it as {fixed[moved[0]]}; give a plan that fixes the layouts "
                "(a preset such as 'fsdp+tp') or call with the example inputs' sizes"
            )
        return held

    def _varying(self, sig: Signature) -> tuple[tuple[int, int], ...]:
        """The ``(input, dim)`` sizes beyond the batch dim in which ``sig`` differs from a program
        held for the same call otherwise: worth one symbolic program rather than one per size."""
        for other in self._held:
            found = _size_changes(sig, other)
            if found:
                return found
        return ()

    def _hold(self, sig: Signature, held: Program | str) -> None:
        if len(self._held) >= self.size:
            old, _ = self._held.popitem(last=False)
            self.evicted += 1
            warnings.warn(
                f"meshfold: this module holds {self.size} compiled programs (cache_size); dropped the one for "
                f"{old.describe(self.names)}. Calls that vary in shape recompile each time: keep shapes fixed "
                "(pad the last batch), or raise cache_size",
                stacklevel=4,
            )
        self._held[sig] = held

    def report(self) -> list[tuple[str, int]]:
        """(signature, calls) of every program held, least recently used first; refused signatures
        show ``-1`` calls."""
        names = self.names
        return [(s.describe(names), p.calls if isinstance(p, Program) else -1) for s, p in self._held.items()]


def _size_changes(a: Signature, b: Signature) -> tuple[tuple[int, int], ...]:
    """The ``(input, dim)`` sizes, batch dim excepted, in which ``a`` differs from ``b``; empty when
    anything else differs (mode, dtypes, the batch, other values)."""
    if (a.training, a.grad) != (b.training, b.grad) or len(a.inputs) != len(b.inputs):
        return ()
    out: list[tuple[int, int]] = []
    for k, (x, y) in enumerate(zip(a.inputs, b.inputs, strict=True)):
        if x[0] != "tensor" or y[0] != "tensor":
            if x != y:
                return ()
            continue
        if x[2:] != y[2:] or len(x[1]) != len(y[1]) or (x[1] and x[1][0] != y[1][0]):
            return ()
        out += [(k, d) for d in range(1, len(x[1])) if x[1][d] != y[1][d]]
    return tuple(out)


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
