"""The lowering table's machinery: op target (or op kind) → lowering function, and what one gets.

A lowering function takes an :class:`EmitContext` (the fx graph being built, the fx node of every
value lowered so far, the rank, the local forms, the generator) and one IR op, and returns one fx
node per result of the op. ``LoweringTable.lookup`` says which function lowers an op.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from meshfold import ir
from meshfold.backends.local import LocalForms
from meshfold.ir import Op, OpDef, Target, Value, target_name
from meshfold.ir.graph import Arg


@dataclass(frozen=True)
class RankContext:
    """What lowering needs to know about this rank: mesh sizes, its coordinate, group names."""

    mesh: ir.Mesh
    coordinate: tuple[int, ...]
    group_names: tuple[str, ...]
    flat_groups: tuple[tuple[tuple[str, ...], str], ...] = ()
    """Groups over several mesh axes at once (``exchange_axes`` says which a graph needs)."""
    gloo: bool = False
    """Whether the collectives run on gloo (CPU tensors): all-gathers and reduce-scatters are then
    sent as all-to-alls (``comm.issue``'s ``gloo``)."""
    cp_method: str = "ring"
    """How an attention split along the sequence runs (``passes.cp.CpSpec``): ``ring`` attention or
    ``tokenring``."""

    def size(self, axis: str) -> int:
        return self.mesh.size(axis)

    def coord(self, axis: str) -> int:
        return self.coordinate[self.mesh.index(axis)]

    def group(self, axis: str) -> str:
        return self.group_names[self.mesh.index(axis)]

    def group_over(self, axes: tuple[str, ...]) -> str:
        """The process group spanning ``axes`` (in mesh order), ranks numbered row-major."""
        if len(axes) == 1:
            return self.group(axes[0])
        for key, name in self.flat_groups:
            if key == axes:
                return name
        raise ValueError(f"no process group over mesh axes {axes}; create it before lowering (exchange_axes)")


@dataclass(frozen=True)
class EmitContext:
    """What every lowering function reads: the fx graph it adds nodes to, the fx node of each IR
    value lowered so far (``env``, filled in as the module is built), the rank, the local forms
    (``backends/local.py``) and the generator random ops draw from."""

    graph: fx.Graph
    env: dict[Value, fx.Node]
    rank: RankContext
    local: LocalForms
    rng: torch.Generator

    def load(self, a: Arg) -> Any:
        """An op argument as the fx node argument it becomes (values by their nodes)."""
        if isinstance(a, Value):
            return self.env[a]
        if isinstance(a, tuple):
            return [self.load(x) for x in a]
        return a

    def local_args(self, op: Op) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The args and kwargs this rank calls ``op`` with (shape-spelling arguments localized)."""
        return self.local.local_args(op, self.rank.mesh)

    def call(
        self, op: Op, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], head: Sequence[Any] = ()
    ) -> list[fx.Node]:
        """One call of ``fn`` on ``head`` then ``args`` loaded (and ``kwargs``): ``op``'s result nodes."""
        loaded = (*head, *(self.load(a) for a in args))
        node = self.graph.call_function(fn, loaded, {k: self.load(v) for k, v in kwargs.items()})
        return unpacked(self.graph, op, node)


LowerFn = Callable[[EmitContext, Op], list[fx.Node]]
"""Given the context and one op, the fx nodes of the op's results, in order."""


@dataclass(frozen=True)
class Kind:
    """Ops matched by what they are rather than by target (every op that draws, every ``OpDef``)."""

    name: str
    matches: Callable[[Op], bool]
    lower: LowerFn


@dataclass
class LoweringTable:
    """Lowering functions by op target, by op kind, and a default; :meth:`lookup` picks one.

    Lookup order (the first that applies):

    1. kinds registered with ``first=True``, in registration order (ops that draw random numbers:
       whatever else such an op is, its draw follows meshfold's generator or is refused);
    2. the op's exact target (``@table.op(target, ...)``);
    3. the other kinds, in registration order (our ``comm.*`` collectives, as one family);
    4. the default (``@table.fallback``): the op called on local tensors.
    """

    name: str
    targets: dict[Target, LowerFn] = field(default_factory=dict)
    first: list[Kind] = field(default_factory=list)
    kinds: list[Kind] = field(default_factory=list)
    default: LowerFn | None = None

    def op(self, *targets: Target) -> Callable[[LowerFn], LowerFn]:
        """``@LOWERINGS.op(SCAN, SCAN_BACKWARD)`` registers the lowering of those targets."""

        def deco(fn: LowerFn) -> LowerFn:
            for t in targets:
                if t in self.targets:
                    raise ValueError(f"{self.name}: two lowerings for {target_name(t)}")
                self.targets[t] = fn
            return fn

        return deco

    def kind(self, name: str, matches: Callable[[Op], bool], *, first: bool = False) -> Callable[[LowerFn], LowerFn]:
        """Register the lowering of every op ``matches`` accepts (see the lookup order)."""

        def deco(fn: LowerFn) -> LowerFn:
            (self.first if first else self.kinds).append(Kind(name, matches, fn))
            return fn

        return deco

    def fallback(self, fn: LowerFn) -> LowerFn:
        """Register the lowering of every op nothing else claims."""
        assert self.default is None, f"{self.name}: two default lowerings"
        self.default = fn
        return fn

    def lookup(self, op: Op) -> LowerFn:
        """The function that lowers ``op`` (the class docstring gives the order)."""
        for k in self.first:
            if k.matches(op):
                return k.lower
        fn = self.targets.get(op.target)
        if fn is not None:
            return fn
        for k in self.kinds:
            if k.matches(op):
                return k.lower
        assert self.default is not None, f"{self.name}: no default lowering"
        return self.default

    def lower(self, ctx: EmitContext, op: Op) -> list[fx.Node]:
        """``op``'s result nodes, lowered by the function :meth:`lookup` picks."""
        return self.lookup(op)(ctx, op)


def unpacked(g: fx.Graph, op: Op, node: fx.Node) -> list[fx.Node]:
    """One node per result of ``op`` (``getitem``s when the call returns several)."""
    if len(op.results) == 1 and not _returns_sequence(op):
        return [node]
    return [g.call_function(operator.getitem, (node, i)) for i in range(len(op.results))]


def _returns_sequence(op: Op) -> bool:
    target = op.target
    assert not isinstance(target, OpDef)
    rets = target._schema.returns
    return len(rets) != 1 or str(rets[0].type).startswith("List")
