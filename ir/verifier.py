"""Structural and type checks on a graph. Passes' tests run it after every pass."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable, Iterator, Sequence

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from meshfold.ir.asynchrony import ScheduleError, check_inflight, check_waits
from meshfold.ir.graph import Arg, Graph, GraphOutput, Op, Value
from meshfold.ir.ops import OpDef
from meshfold.ir.placement import Layout, Shard, reduce_refusal
from meshfold.ir.types import TensorType, dtype_name, type_of

# NOTE: sizes are checked before anything is made for them (even a fake tensor): every static dim is
# >= 0 and a static shape has fewer than MAX_NUMEL elements (the parser enforces the same bound).
MAX_NUMEL = 2**62

# NOTE: matrix products do not promote: every tensor operand must have the same dtype. Fake/meta
# kernels do not all check this (``aten.addmm`` with an i64 operand passes them and fails when run),
# so the verifier checks it itself, naming the operand, before running the op on fake tensors.
_SAME_DTYPE_OPS = frozenset(
    f"aten::{n}" for n in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "matmul", "linear")
)


class VerifyError(ValueError):
    """The graph breaks an IR invariant; the message names the op, its provenance and the fix."""


def verify(
    graph: Graph,
    *,
    check_types: bool = True,
    max_inflight: float | None = None,
    classes: Sequence[int] | None = None,
) -> None:
    """Raise :class:`VerifyError` unless ``graph`` is well formed.

    Checks: SSA (every value defined once, before use), unique input names, layouts that match the
    graph's mesh and value ranks, sizes (dims >= 0, fewer than 2**62 elements), and — with
    ``check_types`` — operand dtypes of ops that do not promote, and that every ATen op's result types
    equal what the op computes on fake tensors of its operand types. Errors name the op (with its
    provenance), the values and the types; one about something read from IR text (``ir.parse``: an
    input or output of the graph it returned, or an op, also after passes that kept its provenance)
    starts with where the text wrote it, ``<file>:L:C: `` or ``line L, column C: ``; nothing else
    escapes. Started collectives (``ir.asynchrony``): every wait reads one start's handles, nothing
    else does, and with ``max_inflight`` a rank never holds more bytes in flight than that.
    ``classes``: ``key_classes(graph.ops)``, where the caller has it.
    """
    try:
        _verify(graph, check_types, classes)
        check_waits(graph)
        if max_inflight is not None:
            check_inflight(graph, max_inflight)
    except _Failure as f:
        raise VerifyError(f.located(graph)) from None
    except ScheduleError as e:
        raise VerifyError(str(e)) from None


def verify_op_types(ops: Sequence[Op]) -> None:
    """Raise :class:`VerifyError` unless each op's result types are what it computes on fake tensors
    of its operand types (the type check of :func:`verify`, for some ops of a static graph)."""
    fake = _FakeRunner()
    for op, number in zip(ops, key_classes(ops), strict=True):
        try:
            fake.check(op, number)
        except _Failure as f:
            raise VerifyError(f.located(None)) from None


class _Failure(Exception):
    """A broken invariant, with the input value, op or output it is about (to find its text position).

    NOTE: a message about an op names it by ``_described`` (no text position): ``located`` puts the
    position first, once."""

    def __init__(self, message: str, item: Value | Op | GraphOutput | None = None) -> None:
        super().__init__(message)
        self.message, self.item = message, item

    def located(self, graph: Graph | None) -> str:
        """The message, led by ``<file>:L:C: `` where the item was read from text (an op's position
        from its provenance; an input's or output's from ``graph``, the parser's)."""
        if isinstance(self.item, Op):
            at = self.item.prov.position
        else:
            at = graph.position_of(self.item) if graph is not None and self.item is not None else None
        return self.message if at is None else f"{at}: {self.message}"


def key_classes(ops: Sequence[Op]) -> list[int]:
    """For each op, a number that the ops of one ``Op.key`` share and no other op has (-1 for
    meshfold's own ops). A check that reads nothing but an op's key (its type check, its sharding
    rule's strategies) keeps its verdicts by this number: hashing and comparing a key is Python calls
    (its types), so the keys of a graph are numbered once for every such check of it."""
    numbers: dict[Hashable, int] = {}
    return [-1 if isinstance(op.target, OpDef) else numbers.setdefault(op.key(), len(numbers)) for op in ops]


def _verify(graph: Graph, check_types: bool, classes: Sequence[int] | None = None) -> None:
    defined: set[Value] = set()
    sizes = _Sizes(Layout.replicated(graph.mesh).axes)
    names: set[str] = set()
    for i in graph.inputs:
        if i.name in names:
            raise _Failure(f"graph @{graph.name}: input %{i.name} appears twice", i.value)
        names.add(i.name)
        _define(i.value, defined, f"input %{i.name}", i.value, sizes)
    fake = _FakeRunner() if check_types else None
    if classes is None:
        classes = key_classes(graph.ops) if fake is not None else [-1] * len(graph.ops)
    for op, number in zip(graph.ops, classes, strict=True):
        if not defined.issuperset(op.operands):
            v = next(v for v in op.operands if v not in defined)
            raise _Failure(f"{_described(op)}: operand %{v.name} is not defined before this op", op)
        for r in op.results:
            _define(r, defined, None, op, sizes)
        if isinstance(op.target, OpDef):
            _check_reduce(op)
        elif fake is not None:
            fake.check(op, number)
    for o in graph.outputs:
        if o.value not in defined:
            raise _Failure(f"graph @{graph.name}: output {o.kind}({o.name}) uses undefined %{o.value.name}", o)


class _Sizes:
    """Checks a value's shape and layout (``_check_shape``, ``_check_layout``) against the graph's
    mesh axes once per type and layout: the checks read nothing else but the name in an error, and
    the values of every layer share a few type and layout objects."""

    def __init__(self, axes: tuple[str, ...]) -> None:
        self.axes = axes
        self.passed: set[tuple[int, int]] = set()
        """``id``s of (type, layout) pairs that passed (the graph being checked holds the objects)."""

    def check(self, v: Value) -> None:
        """Check ``v`` (``_define`` asks only for a pair not in ``passed``)."""
        _check_shape(v)
        _check_layout(v, self.axes)
        self.passed.add((id(v.type), id(v.layout)))


def _define(v: Value, defined: set[Value], where: str | None, item: Value | Op, sizes: _Sizes) -> None:
    """``where``: the definition as errors name it (None: ``item``, an op, describes itself; made
    only for an error, as every op of the graph passes here)."""
    if v in defined:
        raise _Failure(f"{where or _described(item)}: value %{v.name} is defined twice", item)
    defined.add(v)
    if (id(v.type), id(v.layout)) in sizes.passed:
        return
    try:
        sizes.check(v)
    except _Failure as f:
        raise _Failure(f"{where or _described(item)}: {f.message}", item) from None


def _described(item: Value | Op) -> str:
    """``item`` as the verifier's errors name it: an op without its text position (``_Failure.located``
    leads the message with it)."""
    return item.describe(position=False) if isinstance(item, Op) else f"%{item.name}"


def _check_shape(v: Value) -> None:
    if not isinstance(v.type, TensorType):
        return
    n = 1
    for d in v.type.shape:
        if isinstance(d, int) or d.is_Integer:
            if int(d) < 0:
                raise _Failure(f"%{v.name} : {v.type} has a negative dimension {d}; sizes must be >= 0")
            n *= int(d)
        elif d.is_negative:
            raise _Failure(f"%{v.name} : {v.type} has a negative dimension {d}; sizes must be >= 0")
    if n >= MAX_NUMEL:
        raise _Failure(f"%{v.name} : {v.type} has {n} elements; the limit is 2**62")


def _check_layout(v: Value, expected: tuple[str, ...]) -> None:
    """``expected``: the axes of the graph's mesh (a replicated layout's)."""
    if v.layout.axes != expected:
        raise _Failure(f"%{v.name} has layout axes {v.layout.axes} but the graph's mesh has {expected}")
    for axis, p in zip(v.layout.axes, v.layout.placements, strict=True):
        if isinstance(p, Shard):
            rank = v.type.rank if isinstance(v.type, TensorType) else 0
            if not 0 <= p.dim < rank:
                raise _Failure(f"%{v.name} : {v.type} is sharded on dim {p.dim} over {axis!r}, but it has rank {rank}")


class _FakeRunner:
    """Checks an ATen op's operand dtypes and runs it on fake tensors to recompute result types; an
    op whose ``Op.key`` passed before (the same op in every layer of a stack) is not checked again:
    both checks read nothing else (the key holds the target and every operand's and result's type)."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.passed: set[int] = set()
        """``key_classes`` numbers of the keys that passed."""

    def check(self, op: Op, number: int) -> None:
        """``number``: the op's ``key_classes`` number."""
        if number in self.passed:
            return
        _check_dtypes(op)
        self._run(op)
        self.passed.add(number)

    def _run(self, op: Op) -> None:
        if any(not isinstance(v.type, TensorType) or not v.type.is_static() for v in op.operands):
            return
        if _symbolic(op.args) or _symbolic(tuple(v for _, v in op.kwargs)):
            return  # NOTE: a symbolic size argument: checked where the call's sizes are substituted
        with self.mode, _no_dispatch_warnings():
            args = _materialize(op.args)
            kwargs = {k: _materialize(v) for k, v in op.kwargs}
            try:
                out = op.target(*args, **kwargs)  # type: ignore[operator, misc]
            except Exception as e:
                listing = ", ".join(f"%{v.name}: {v.type}" for v in op.operands)
                raise _Failure(f"{_described(op)}: the op rejects its operand types ({listing}): {e}", op) from None
        got = [x for x in _flatten(out)]
        if len(got) != len(op.results):
            raise _Failure(f"{_described(op)}: computes {len(got)} results but declares {len(op.results)}", op)
        for r, g in zip(op.results, got, strict=True):
            actual = type_of(g)
            if actual != r.type:
                raise _Failure(
                    f"{_described(op)}: result %{r.name} is declared {r.type} but the op computes {actual}", op
                )


def _check_dtypes(op: Op) -> None:
    """Ops in ``_SAME_DTYPE_OPS`` need one dtype for all tensor operands (the first operand's)."""
    if op.target._schema.name not in _SAME_DTYPE_OPS:  # type: ignore[union-attr]
        return
    tensors = [v for v in op.operands if isinstance(v.type, TensorType)]
    for v in tensors[1:]:
        first = tensors[0]
        assert isinstance(v.type, TensorType) and isinstance(first.type, TensorType)
        if v.type.dtype != first.type.dtype:
            got, want = dtype_name(v.type.dtype), dtype_name(first.type.dtype)
            listing = ", ".join(f"%{t.name}: {t.type}" for t in tensors)
            raise _Failure(
                f"{_described(op)}: operand %{v.name} of {op.name} is {got} where {want} is required "
                f"(the dtype of %{first.name}; {op.name} does not promote, operands {listing})",
                op,
            )


def _check_reduce(op: Op) -> None:
    """A ``comm.*`` op that reduces (its ``reduce``) reduces every operand's dtype meaningfully
    (``placement.reduce_refusal``): refused here, at compile time, before any rank runs a collective."""
    assert isinstance(op.target, OpDef)
    if "reduce" not in op.target.attrs:
        return
    reduce = str(op.kwarg("reduce"))
    for v in op.operands:
        why = reduce_refusal(reduce, v.type.dtype) if isinstance(v.type, TensorType) else None
        if why is not None:
            raise _Failure(f"{_described(op)}: {op.name}(reduce={reduce!r}) of %{v.name}: {v.type}: {why}", op)


def _symbolic(a: Arg) -> bool:
    if isinstance(a, tuple):
        return any(_symbolic(x) for x in a)
    return isinstance(a, sympy.Expr) and not a.is_Integer


def _materialize(a: Arg) -> object:
    if isinstance(a, Value):
        assert isinstance(a.type, TensorType)
        return torch.empty(tuple(int(d) for d in a.type.shape), dtype=a.type.dtype)
    if isinstance(a, tuple):
        return [_materialize(x) for x in a]
    return a


def _flatten(out: object) -> Iterator[object]:
    if isinstance(out, (tuple, list)):
        for x in out:
            yield from _flatten(x)
    else:
        yield out


@contextlib.contextmanager
def _no_dispatch_warnings() -> Iterator[None]:
    # NOTE: fake tensors log a traceback when a meta kernel rejects its inputs; the verifier
    # reports that rejection itself as a VerifyError, so the log is silenced meanwhile.
    log = logging.getLogger("torch._subclasses.fake_tensor")
    was, log.disabled = log.disabled, True
    try:
        with torch.no_grad():
            yield
    finally:
        log.disabled = was
