"""``cleanup``: dead-code elimination, common-subexpression elimination and trivial views."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from meshfold.ir import Graph, GraphBuilder, Op, PatternTable, Rewriter, Value, apply_patterns, is_pure, view_trait
from meshfold.ir.graph import Arg, remap_op
from meshfold.ir.ops import Target
from meshfold.passes.base import CLEAN, JOINT, Pass

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

aten = torch.ops.aten

TRIVIAL_VIEWS = PatternTable("trivial-views")


def _same_type(op: Op) -> bool:
    src = op.args[0]
    return isinstance(src, Value) and src.type == op.result.type and src.layout == op.result.layout


@TRIVIAL_VIEWS.register(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.alias.default,
    aten.detach.default,
)
def _identity_view(rw: Rewriter, op: Op) -> Sequence[Value] | None:
    """A view, reshape or expand to the operand's own shape (and alias/detach) is the operand."""
    src = op.args[0]
    return (src,) if _same_type(op) and isinstance(src, Value) else None


@TRIVIAL_VIEWS.register(aten.permute.default)
def _identity_permute(rw: Rewriter, op: Op) -> Sequence[Value] | None:
    """``permute(x, [0, 1, ..., n-1])`` is ``x``."""
    src, dims = op.args[0], op.args[1]
    if isinstance(src, Value) and isinstance(dims, tuple) and list(dims) == list(range(len(dims))):
        return (src,)
    return None


@TRIVIAL_VIEWS.register(aten.t.default)
def _double_transpose(rw: Rewriter, op: Op) -> Sequence[Value] | None:
    """``t(t(x))`` is ``x``."""
    src = op.args[0]
    inner = rw.producer(src)
    if inner is not None and inner.target == aten.t.default and isinstance(inner.args[0], Value):
        x = inner.args[0]
        return (x,) if x.type == op.result.type and x.layout == op.result.layout else None
    return None


@TRIVIAL_VIEWS.register(aten.view.default, aten._unsafe_view.default)
def _view_of_view(rw: Rewriter, op: Op) -> Sequence[Value] | None:
    """``view(view(x, a), b)`` is ``view(x, b)`` (the inner op any strided view, ``ir.view_trait``)."""
    src = op.args[0]
    inner = rw.producer(src)
    trait = None if inner is None else view_trait(inner.target)
    if inner is not None and trait is not None and trait.strided:
        return rw.emit(op.target, (inner.args[0], *op.args[1:]), op.kwargs, like=op)
    return None


@dataclass(frozen=True)
class Cleanup(Pass):
    """Remove trivial views, merge identical pure ops, drop ops whose results nobody uses.

    Never touches ops that mutate or draw random numbers (``ir.is_pure``).
    """

    name: ClassVar[str] = "cleanup"
    requires: ClassVar[frozenset[str]] = frozenset({JOINT})
    ensures: ClassVar[frozenset[str]] = frozenset({CLEAN})
    invalidates: ClassVar[frozenset[str]] = frozenset()
    views: bool = True
    cse: bool = True
    dce: bool = True

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        settled: set[Op] = set()
        # NOTE: what is known to be a no-op is skipped: CSE's output has no two pure ops computing the
        # same, and DCE keeps that (it only drops ops) and is a no-op on its own output; only a
        # rewrite by a view pattern makes them worth running again.
        merged = swept = False
        for _ in range(8):
            before = len(graph.ops)
            if self.views:
                rewritten = apply_patterns(graph, TRIVIAL_VIEWS, settled=settled)
                if rewritten.ops is not graph.ops:
                    merged = swept = False
                graph = rewritten
            if self.cse and not merged:
                merged, was = True, graph
                graph = eliminate_common_subexpressions(graph)
                swept = swept and graph is was
            if self.dce and not swept:
                swept = True
                graph = eliminate_dead_code(graph)
            if len(graph.ops) == before:
                break
        return graph


def eliminate_dead_code(graph: Graph) -> Graph:
    """Drop pure ops none of whose results reach an output."""
    live: set[Value] = {o.value for o in graph.outputs}
    keep: list[Op] = []
    for op in reversed(graph.ops):
        if live.isdisjoint(op.results) and is_pure(op.target):
            continue
        keep.append(op)
        live.update(op.operands)
    if len(keep) == len(graph.ops):
        return graph
    b = GraphBuilder.like(graph)
    for op in reversed(keep):
        b.append(op)
    for o in graph.outputs:
        b.add_output(o.kind, o.name, o.value)
    return b.build()


def _key(arg: Arg) -> object:
    if isinstance(arg, Value):
        return arg  # NOTE: values hash and compare by identity: the very same value
    if isinstance(arg, tuple):
        return tuple([_key(a) for a in arg])
    if isinstance(arg, float):
        return ("f", repr(arg))
    return (type(arg).__name__, arg)


def computation_key(
    target: Target, args: tuple[Arg, ...], kwargs: tuple[tuple[str, Arg], ...], out: tuple[Value, ...]
) -> object:
    """Equal for two calls of a pure op that compute the same values: the same target, the very same
    operand values, equal constants (``-0.0`` is not ``0.0``) and equal result types and layouts.
    (The target by identity: an overload is one object for the process, and hashing it is a Python
    call; ops of every layer ask.)"""
    types = tuple([(r.type, r.layout) for r in out])
    kw = tuple([_key(v) for _, v in kwargs]) if kwargs else ()
    return (id(target), _key(args), kw, tuple([k for k, _ in kwargs]), types)


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    """Reuse the first of several pure ops with the same target, arguments and result types."""
    # NOTE: two ops compute the same only if they call one target on the very same values, in the
    # same order: keyed by that first (a hash of identities, no Python call), the full
    # ``computation_key`` is made only for ops that share it with an earlier op.
    seen: dict[tuple[int, tuple[Value, ...]], Op] = {}
    same: dict[object, Op] = {}
    vmap: dict[Value, Value] = {}
    b = GraphBuilder.like(graph)
    changed = False
    for op in graph.ops:
        new = remap_op(op, vmap)
        if is_pure(op.target):
            first = seen.setdefault((id(op.target), new.operands), new)
            if first is not new:
                first = _first_same(same, first, new)
                if first is not new:
                    vmap.update(zip(op.results, first.results, strict=True))
                    changed = True
                    continue
        b.append(new)
    if not changed:
        return graph
    for o in graph.outputs:
        b.add_output(o.kind, o.name, vmap.get(o.value, o.value))
    return b.build()


def _first_same(same: dict[object, Op], first: Op, op: Op) -> Op:
    """The earliest op kept that computes what ``op`` does (``op`` itself if none): ``first`` is the
    earliest op kept calling its target on its values; ``same`` holds, by ``computation_key``, every
    other kept op that shares that with an earlier one, and every such earliest one already asked."""
    same.setdefault(_computation_key_of(first), first)
    return same.setdefault(_computation_key_of(op), op)


def _computation_key_of(op: Op) -> object:
    return computation_key(op.target, op.args, op.kwargs, op.results)
