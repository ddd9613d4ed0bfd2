"""The IR: a ``Graph`` of ``Op``s in topological order, each producing ``Value``s.

Values and ops are immutable; a pass builds a new graph with :class:`GraphBuilder`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import sympy
import torch

from meshfold.ir.mesh import Mesh
from meshfold.ir.ops import Target, target_name
from meshfold.ir.placement import Layout
from meshfold.ir.symbolic import size_hint
from meshfold.ir.types import TensorType, Type

Phase = Literal["fwd", "bwd"]
InputKind = Literal["param", "buffer", "input", "tangent"]
OutputKind = Literal["out", "grad", "update"]
INPUT_KINDS: tuple[InputKind, ...] = ("param", "buffer", "input", "tangent")
OUTPUT_KINDS: tuple[OutputKind, ...] = ("out", "grad", "update")


@dataclass(frozen=True, slots=True, eq=False)
class Value:
    """An SSA value. Identity is the value; ``name`` is a hint the printer makes unique."""

    name: str
    type: Type
    layout: Layout = field(default_factory=Layout)

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


Literal_: TypeAlias = (
    int | float | bool | str | sympy.Expr | torch.dtype | torch.device | torch.layout | torch.memory_format | None
)
Arg: TypeAlias = Value | Literal_ | tuple["Arg", ...]


def local_nbytes(v: Value, mesh: Mesh | None) -> int:
    """Bytes of ``v``'s shard on one rank (``Layout.local_shape``: even splits only; a symbolic size at
    its hint, ``size_hint``); without a mesh, all of it. Not a tensor: 0."""
    t = v.type
    if not isinstance(t, TensorType):
        return 0
    shape = v.layout.local_shape(t.shape, mesh) if mesh is not None else t.shape
    n = 1
    for d in shape:
        n *= size_hint(d)
    return int(n) * t.dtype.itemsize


@dataclass(frozen=True, slots=True)
class TextPosition:
    """Where IR text wrote something: ``file`` (None: text without a name), 1-based ``line`` and
    ``column`` (counted from the start of the line, as editors count)."""

    file: str | None
    line: int
    column: int

    def __str__(self) -> str:
        """``graph.ir:6:3`` (what editors and terminals open), or ``line 6, column 3`` without a file."""
        if self.file is None:
            return f"line {self.line}, column {self.column}"
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True, slots=True, eq=False)
class Provenance:
    """Where an op came from: the module path in the user's model, its phase, and source line."""

    module: str = ""
    phase: Phase = "fwd"
    source: str | None = None

    # NOTE: equal and hashed by (module, phase, source) only, whatever the class: the provenance of an
    # op read from text (``TextProvenance``) equals that of the same op built in code, so where the
    # text wrote an op never makes two programs differ (``first_difference``) or two ops distinct.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Provenance):
            return NotImplemented
        return (self.module, self.phase, self.source) == (other.module, other.phase, other.source)

    def __hash__(self) -> int:
        return hash((self.module, self.phase, self.source))

    @property
    def position(self) -> TextPosition | None:
        """Where IR text wrote the op (``TextProvenance``); None for an op built in code."""
        return None

    def describe(self, *, position: bool = True) -> str:
        """``layers.0.mlp (bwd, model.py:12)``, then `` [graph.ir:7:3]`` for an op read from IR text
        (unless ``position`` is False: for a message that leads with the position itself)."""
        where = self.module or "<root>"
        text = f"{where} ({self.phase}{', ' + self.source if self.source else ''})"
        at = self.position if position else None
        return text if at is None else f"{text} [{at}]"


@dataclass(frozen=True, slots=True, eq=False)
class TextProvenance(Provenance):
    """The provenance of an op the parser read: also where the text wrote it (``at``). Passes that
    keep an op's ``prov`` keep this, so their errors (``Op.describe``) name the IR line too.

    NOTE: only the parser makes these; ops built in code keep a plain ``Provenance`` (no extra slot),
    and the position is never printed (the text form round-trips) nor compared (see ``Provenance``)."""

    at: TextPosition = field(kw_only=True)

    @property
    def position(self) -> TextPosition:
        return self.at


@dataclass(frozen=True, slots=True, eq=False)
class Op:
    """A call of ``target`` on ``args``/``kwargs`` producing ``results``."""

    target: Target
    args: tuple[Arg, ...]
    kwargs: tuple[tuple[str, Arg], ...]
    results: tuple[Value, ...]
    prov: Provenance = Provenance()
    operands: tuple[Value, ...] = field(init=False, repr=False)
    """Every value used by this op, in argument order (duplicates kept)."""
    _key: Hashable = field(init=False, repr=False, default=None)
    """``key()``, once asked (every part of it is immutable)."""

    def __post_init__(self) -> None:
        found: list[Value] = []
        _values_in(self.args, found)
        for _, v in self.kwargs:
            _values_in((v,), found)
        object.__setattr__(self, "operands", tuple(found))

    @property
    def name(self) -> str:
        return target_name(self.target)

    @property
    def result(self) -> Value:
        if len(self.results) != 1:
            raise ValueError(f"{self.name} has {len(self.results)} results, not one")
        return self.results[0]

    def kwarg(self, key: str, default: Arg = None) -> Arg:
        for k, v in self.kwargs:
            if k == key:
                return v
        return default

    def describe(self, *, position: bool = True) -> str:
        """Short description for errors: op name, module path, phase and source line, and for an op
        read from IR text where the text wrote it (``Provenance.describe``)."""
        return f"{self.name} at {self.prov.describe(position=position)}"

    def key(self) -> Hashable:
        """What the op computes, up to which values it reads: target, arguments with each value
        replaced by its type, and result types (``cat([%a, %b], -1)`` in one layer keys as
        ``cat([%c, %d], -1)`` in the next). Anything decided from an op's types alone (its type
        check, its sharding strategies, its work) is the same for ops of one key."""
        if self._key is None:
            key = (
                self.target,
                _skeleton(self.args),
                tuple((k, _skeleton(v)) for k, v in self.kwargs),
                tuple(r.type for r in self.results),
            )
            object.__setattr__(self, "_key", key)
        return self._key


def _values_in(args: tuple[Arg, ...], found: list[Value]) -> None:
    """Append the values in ``args`` (nested tuples walked) to ``found``, in order (every op made
    asks: a loop, not a generator per level)."""
    for a in args:
        if isinstance(a, Value):
            found.append(a)
        elif isinstance(a, tuple):
            _values_in(a, found)


def _skeleton(a: Arg) -> Hashable:
    if isinstance(a, Value):
        return ("%", a.type)
    if isinstance(a, tuple):
        return tuple(_skeleton(x) for x in a)
    return a


def freeze_arg(arg: object) -> Arg:
    """Lists become tuples (recursively) so an argument is immutable and printable."""
    if isinstance(arg, (list, tuple)):
        return tuple(freeze_arg(a) for a in arg)
    return arg  # type: ignore[return-value]


def fresh_name(base: str, taken: set[str]) -> str:
    """``base``, else ``base_1``, ``base_2``, ...: the first not in ``taken``, which it joins (a pass
    naming the values it adds)."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def map_values(arg: Arg, fn: dict[Value, Value]) -> Arg:
    """Replace every value in a (nested) argument by ``fn[value]`` (values not in ``fn`` stay)."""
    if isinstance(arg, Value):
        return fn.get(arg, arg)
    if isinstance(arg, tuple):
        return tuple(map_values(a, fn) for a in arg)
    return arg


def remap_op(op: Op, fn: dict[Value, Value]) -> Op:
    """``op`` reading ``fn[value]`` for every value it reads that is in ``fn``; ``op`` itself where it
    reads none of them."""
    if not fn:
        return op
    for v in op.operands:
        if v in fn:
            break
    else:
        return op
    args = tuple(map_values(a, fn) for a in op.args)
    kwargs = tuple((k, map_values(v, fn)) for k, v in op.kwargs)
    return Op(op.target, args, kwargs, op.results, op.prov)


@dataclass(frozen=True, slots=True)
class GraphInput:
    """A graph input: a parameter or buffer (named by FQN), a user input, or a backward tangent."""

    kind: InputKind
    value: Value

    @property
    def name(self) -> str:
        return self.value.name


@dataclass(frozen=True, slots=True)
class GraphOutput:
    """A graph output: a user output (``out``, named by position), a gradient (``grad`` of an FQN),
    or the new value of a buffer updated in place (``update`` of an FQN)."""

    kind: OutputKind
    name: str
    value: Value


@dataclass(frozen=True, slots=True)
class ParamStack:
    """A parameter input made of several model parameters: row ``e`` of ``name`` (dim 0) is
    ``members[e]``, the one parameter itself or several stacked on a new dim 0 (an expert's gate and
    up weights as ``[2, I, H]``). Capture makes these when it folds experts held in an ``nn.ModuleList``
    into one experts op (``meshfold.rewrites.moe_lists``); the runtime builds them from, and maps them back to,
    the model's own parameters."""

    name: str
    members: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, slots=True, eq=False)
class Graph:
    """A whole program: inputs, ops in topological order, outputs, and the mesh it runs on."""

    name: str
    inputs: tuple[GraphInput, ...]
    ops: tuple[Op, ...]
    outputs: tuple[GraphOutput, ...]
    mesh: Mesh | None = None
    stacks: tuple[ParamStack, ...] = ()
    """Parameter inputs that stack model parameters (see ``ParamStack``)."""

    def __str__(self) -> str:
        from meshfold.ir.printer import print_graph

        return print_graph(self)

    def position_of(self, item: Value | Op | GraphOutput) -> TextPosition | None:
        """Where IR text wrote ``item``: an op's position travels in its provenance (through passes
        that keep it); an input's (its value) and an output's only the parser's graph knows."""
        return item.prov.position if isinstance(item, Op) else None

    def input(self, name: str) -> GraphInput:
        for i in self.inputs:
            if i.name == name:
                return i
        raise KeyError(f"graph @{self.name} has no input named {name!r}")

    def output(self, kind: OutputKind, name: str) -> GraphOutput:
        for o in self.outputs:
            if o.kind == kind and o.name == name:
                return o
        raise KeyError(f"graph @{self.name} has no {kind} output named {name!r}")

    def producers(self) -> dict[Value, Op]:
        return {r: op for op in self.ops for r in op.results}

    def users(self) -> dict[Value, list[Op]]:
        """Map from value to the ops that use it (in program order; graph outputs not included)."""
        out: dict[Value, list[Op]] = {}
        for op in self.ops:
            for v in dict.fromkeys(op.operands):
                out.setdefault(v, []).append(op)
        return out


class GraphBuilder:
    """Builds a graph op by op. The only mutable IR object; passes use one to write their result."""

    def __init__(self, name: str, mesh: Mesh | None = None) -> None:
        self.name = name
        self.mesh = mesh
        self._inputs: list[GraphInput] = []
        self._ops: list[Op] = []
        self._outputs: list[GraphOutput] = []
        self.stacks: tuple[ParamStack, ...] = ()

    @staticmethod
    def like(graph: Graph) -> GraphBuilder:
        """A builder with ``graph``'s name, mesh, inputs and parameter stacks, for a pass writing a new
        version of it."""
        b = GraphBuilder(graph.name, graph.mesh)
        b._inputs.extend(graph.inputs)
        b.stacks = graph.stacks
        return b

    def add_input(self, kind: InputKind, name: str, type_: Type, layout: Layout | None = None) -> Value:
        v = Value(name, type_, layout if layout is not None else Layout.replicated(self.mesh))
        self._inputs.append(GraphInput(kind, v))
        return v

    def keep_input(self, i: GraphInput) -> None:
        """An input of the graph being rewritten, kept as it is (ops reading its value need no remap)."""
        self._inputs.append(i)

    @property
    def inputs(self) -> tuple[GraphInput, ...]:
        return tuple(self._inputs)

    def add_op(
        self,
        target: Target,
        args: Sequence[Arg],
        kwargs: Sequence[tuple[str, Arg]],
        results: Sequence[tuple[str, Type] | Value],
        prov: Provenance = Provenance(),
    ) -> tuple[Value, ...]:
        """Append a call; ``results`` are new values, or (name hint, type) pairs made replicated."""
        vals = tuple(r if isinstance(r, Value) else Value(r[0], r[1], Layout.replicated(self.mesh)) for r in results)
        frozen_kwargs = tuple((k, freeze_arg(v)) for k, v in kwargs)
        self._ops.append(Op(target, tuple(freeze_arg(a) for a in args), frozen_kwargs, vals, prov))
        return vals

    def append(self, op: Op) -> None:
        self._ops.append(op)

    def add_output(self, kind: OutputKind, name: str, value: Value) -> None:
        self._outputs.append(GraphOutput(kind, name, value))

    def build(self) -> Graph:
        return Graph(self.name, tuple(self._inputs), tuple(self._ops), tuple(self._outputs), self.mesh, self.stacks)


def first_difference(a: Graph, b: Graph) -> str | None:
    """Where two graphs first differ as programs, or None if they are the same program: inputs and
    outputs of the same kinds, names and types; ops in the same order with the same targets,
    arguments, result types and provenance, reading corresponding values. Value names (hints) and
    layouts are not compared."""
    sizes = [(len(g.inputs), len(g.ops), len(g.outputs)) for g in (a, b)]
    if sizes[0] != sizes[1]:
        return f"(inputs, ops, outputs) differ: {sizes[0]} against {sizes[1]}"
    to_b: dict[Value, Value] = {}
    for x, y in zip(a.inputs, b.inputs, strict=True):
        if (x.kind, x.name, x.value.type) != (y.kind, y.name, y.value.type):
            return f"input {x.kind} {x.name}: {x.value.type} against {y.kind} {y.name}: {y.value.type}"
        to_b[x.value] = y.value
    for n, (p, q) in enumerate(zip(a.ops, b.ops, strict=True)):
        mapped = (tuple(map_values(x, to_b) for x in p.args), tuple((k, map_values(x, to_b)) for k, x in p.kwargs))
        if p.target != q.target or p.prov != q.prov or mapped != (q.args, q.kwargs):
            return f"op {n}: {p.describe()} against {q.describe()}"
        if tuple(r.type for r in p.results) != tuple(r.type for r in q.results):
            return f"op {n}: result types of {p.describe()} differ"
        to_b.update(zip(p.results, q.results, strict=True))
    for x2, y2 in zip(a.outputs, b.outputs, strict=True):
        if (x2.kind, x2.name, to_b.get(x2.value, x2.value)) != (y2.kind, y2.name, y2.value):
            return f"output {x2.kind}({x2.name}) against {y2.kind}({y2.name})"
    if a.stacks != b.stacks:
        return "parameter stacks differ"
    return None
