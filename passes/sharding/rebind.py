"""An op's arguments with its operands replaced, for a pass rebuilding ops on new values."""

from __future__ import annotations

from meshfold.ir import Op, Value
from meshfold.ir.graph import Arg


def rebind(op: Op, operands: list[Value]) -> tuple[tuple[Arg, ...], tuple[tuple[str, Arg], ...]]:
    """Replace the op's operands, in ``op.operands`` order, by ``operands``."""
    args, used = _replaced(op.args, operands, 0)
    if used == len(operands):  # NOTE: mostly so: the op's keyword arguments hold no value
        return args, op.kwargs
    values, _ = _replaced(tuple(v for _, v in op.kwargs), operands, used)
    return args, tuple((k, v) for (k, _), v in zip(op.kwargs, values, strict=True))


def _replaced(args: tuple[Arg, ...], operands: list[Value], used: int) -> tuple[tuple[Arg, ...], int]:
    """``args`` with its values (nested tuples walked) replaced by ``operands[used:]`` in order, and
    how many operands are used after it. Once every operand is placed the rest is kept as it is:
    the shapes and sizes an op takes are mostly tuples of numbers, after its values."""
    out = list(args)
    for i, a in enumerate(args):
        if used == len(operands):
            break
        if isinstance(a, Value):
            out[i] = operands[used]
            used += 1
        elif isinstance(a, tuple):
            out[i], used = _replaced(a, operands, used)
    return tuple(out), used
