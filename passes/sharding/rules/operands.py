"""Helpers rule modules share: operand types and notation built from shapes."""

from __future__ import annotations

import string
from collections.abc import Sequence

import sympy
from torch._ops import OpOverload

from meshfold.ir import Arg, Op, Partial, R, TensorType, Value
from meshfold.ir.graph import freeze_arg
from meshfold.ir.placement import ReduceOp
from meshfold.ir.symbolic import Dim
from meshfold.passes.sharding.strategy import Einsum, Strategy, einsum_strategies


def tensor_operands(op: Op) -> list[TensorType]:
    """Types of the op's operands (``op.operands`` order); every operand must be a tensor."""
    out = []
    for v in op.operands:
        if not isinstance(v.type, TensorType):
            raise TypeError(f"{op.describe()}: operand %{v.name} is not a tensor")
        out.append(v.type)
    return out


def result_type(op: Op, i: int = 0) -> TensorType:
    t = op.results[i].type
    if not isinstance(t, TensorType):
        raise TypeError(f"{op.describe()}: result {i} is not a tensor")
    return t


def letters(n: int, skip: str = "") -> list[str]:
    """``n`` distinct dim letters (a, b, c, ...) not in ``skip``."""
    pool = [c for c in string.ascii_lowercase if c not in skip]
    return pool[:n]


def broadcast_notation(op: Op, values: list[Value], out: TensorType) -> str:
    """Notation for a broadcasting elementwise op over ``values`` producing ``out``.

    Dims align from the right; an operand dim of size 1 under a larger result dim is ``_``.
    """
    names = letters(out.rank)
    groups = []
    for v in values:
        t = v.type
        assert isinstance(t, TensorType)
        offset = out.rank - t.rank
        dims = []
        for i, size in enumerate(t.shape):
            j = i + offset
            dims.append("_" if (size == 1 and out.shape[j] != 1) else names[j])
        groups.append(" ".join(dims))
    return ", ".join(groups) + " -> " + " ".join(names)


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def tensor_type_of(v: Value) -> TensorType | None:
    """The value's tensor type, or None for a scalar / ``none`` value."""
    return v.type if isinstance(v.type, TensorType) else None


def is_float(t: TensorType | None) -> bool:
    """True for floating-point (and complex) tensors: the only ones that may be Partial."""
    return t is not None and (t.dtype.is_floating_point or t.dtype.is_complex)


def op_arg(op: Op, name: str, default: Arg = None) -> Arg:
    """Argument ``name`` of an ATen op, by keyword or schema position, else its schema default.

    ``default`` is returned when the op is not an ATen overload or the argument is absent and has
    no schema default.
    """
    for k, v in op.kwargs:
        if k == name:
            return v
    target = op.target
    if not isinstance(target, OpOverload):
        return default
    for i, a in enumerate(target._schema.arguments):
        if a.name != name:
            continue
        if i < len(op.args) and not a.kwarg_only:
            return op.args[i]
        if a.has_default_value():
            return freeze_arg(a.default_value)
        return default
    return default


def int_arg(op: Op, name: str, default: int) -> int:
    """An int argument (``dim``, ``index``); a symbolic or missing one gives ``default``."""
    v = op_arg(op, name, default)
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def dims_arg(op: Op, name: str, rank: int) -> list[int]:
    """A dim-list argument normalized to ``0..rank-1``; None or ``[]`` means every dim (reductions)."""
    v = op_arg(op, name, None)
    if v is None or v == ():
        return list(range(rank))
    dims = v if isinstance(v, tuple) else (v,)
    out = []
    for d in dims:
        if not isinstance(d, int):
            raise TypeError(f"{op.describe()}: dim {d!r} is not an int")
        out.append(norm_dim(d, max(rank, 1)))
    return sorted(set(out))


def group_of(v: Value, dims: Sequence[str | None]) -> tuple[str, ...]:
    """Notation group for ``v``: its dims' letters (None → ``_``); a non-tensor value has none."""
    if tensor_type_of(v) is None:
        return ()
    return tuple("_" if d is None else d for d in dims)


def einsum_of(operands: Sequence[Sequence[str]], results: Sequence[Sequence[str]]) -> Einsum:
    """An :class:`Einsum` built directly (the text form cannot spell a lone 0-d operand or result)."""
    return Einsum(tuple(tuple(g) for g in operands), tuple(tuple(g) for g in results))


def broadcast_groups(values: Sequence[Value], out: TensorType) -> list[tuple[str, ...]]:
    """Letters of each value under right-aligned broadcasting to ``out``; size-1 under a larger dim
    is ``_``; a non-tensor value gets no dims."""
    names = letters(out.rank)
    groups: list[tuple[str, ...]] = []
    for v in values:
        t = tensor_type_of(v)
        if t is None:
            groups.append(())
            continue
        offset = out.rank - t.rank
        groups.append(
            tuple(
                "_" if (size == 1 and out.shape[i + offset] != 1) else names[i + offset]
                for i, size in enumerate(t.shape)
            )
        )
    return groups


def broadcast_einsum(op: Op, out: TensorType | None = None) -> Einsum:
    """Elementwise notation for ``op``: every operand broadcast to its (first) result, every result
    spelled like the first (``aten.topk``-style ops must not use this)."""
    res = out or result_type(op)
    names = tuple(letters(res.rank))
    return einsum_of(broadcast_groups(op.operands, res), [names for _ in op.results])


def with_partials(
    strategies: list[Strategy], n_in: int, n_out: int, pairs: Sequence[tuple[Sequence[int], ReduceOp]]
) -> list[Strategy]:
    """Append one strategy per ``(operands, kind)``: those operands ``Partial(kind)``, the others
    Replicate, every result ``Partial(kind)``."""
    out = list(strategies)
    for idx, kind in pairs:
        ins = tuple(Partial(kind) if i in idx else R for i in range(n_in))
        out.append(Strategy(ins, tuple(Partial(kind) for _ in range(n_out))))
    return list(dict.fromkeys(out))


def movement(e: Einsum, n_in: int = 1) -> list[Strategy]:
    """Strategies of a data-movement op (view, permute, slice, expand, ...): the notation's shards,
    and every Partial kind passing from its (only) data operand to every result."""
    n_out = len(e.results)
    base = einsum_strategies(e)
    return with_partials(base, n_in, n_out, [((0,), "sum"), ((0,), "avg"), ((0,), "max")])


def replicate_non_tensor_results(op: Op, strategies: list[Strategy]) -> list[Strategy]:
    """Results that are not tensors (``none``, SymInts) become Replicate in every strategy."""
    keep = [tensor_type_of(r) is not None for r in op.results]
    fixed = [Strategy(s.inputs, tuple(p if k else R for p, k in zip(s.outputs, keep, strict=True))) for s in strategies]
    return list(dict.fromkeys(fixed))


def view_dim_map(src: Sequence[Dim], dst: Sequence[Dim]) -> dict[int, int]:
    """Which ``src`` dims may stay sharded through a reshape to ``dst``, and onto which dim.

    Dims of size 1 are dropped; the rest are grouped by matching products of sizes (``[6, 4] ->
    [2, 3, 4]`` gives groups ``{0} -> {0, 1}`` and ``{1} -> {2}``). A shard of the outermost dim of a
    group is a contiguous block of the flattened group, and so is a shard of the outermost dim of the
    matching output group: that pair is the mapping. Inner dims of a group map nowhere. Symbolic
    products are matched by whole-number ratios.
    """
    if any(s == 0 for s in (*src, *dst)):
        return {}
    a = [i for i, s in enumerate(src) if s != 1]
    b = [j for j, s in enumerate(dst) if s != 1]
    out: dict[int, int] = {}
    i = j = 0
    while i < len(a) and j < len(b):
        first_src, first_dst = a[i], b[j]
        ps, pd = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while ps != pd:
            if not (isinstance(ps, int) and isinstance(pd, int)):
                # NOTE: symbolic products compare by their ratio (``2*s0`` over ``2`` is ``s0``, a whole number)
                if sympy.simplify(pd / ps).is_integer:
                    if i >= len(a):
                        return out
                    ps, i = ps * src[a[i]], i + 1
                    continue
                if sympy.simplify(ps / pd).is_integer:
                    if j >= len(b):
                        return out
                    pd, j = pd * dst[b[j]], j + 1
                    continue
                return out
            if ps < pd:
                if i >= len(a):
                    return out
                ps, i = ps * src[a[i]], i + 1
            else:
                if j >= len(b):
                    return out
                pd, j = pd * dst[b[j]], j + 1
        out[first_src] = first_dst
    return out


def operand_names(op: Op) -> list[str]:
    """The schema argument name of each operand, in ``op.operands`` order (every value of a tensor
    list gets the list's name)."""
    target = op.target
    schema_args = target._schema.arguments if isinstance(target, OpOverload) else []
    out: list[str] = []

    def walk(a: Arg, name: str) -> None:
        if isinstance(a, Value):
            out.append(name)
        elif isinstance(a, tuple):
            for x in a:
                walk(x, name)

    for i, a in enumerate(op.args):
        walk(a, schema_args[i].name if i < len(schema_args) else f"arg{i}")
    for k, v in op.kwargs:
        walk(v, k)
    return out
