"""``meshfold.constant``: a tensor whose values the program holds, as the model's forward made it.

A forward that indexes with a Python list (``x[..., [-1]]``) or assigns a Python scalar into a slice
creates a small tensor at trace time; the captured graph reads it as an attribute. In the IR it is
an op with no operands whose arguments are the values themselves (integers or floats, row-major),
the shape and the dtype, so it prints, parses and verifies like any op, is replicated on every
rank, and runs as a tensor built from its literal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_ELEMENTS = 65536
"""Larger tensors are no literal: a model registers them as buffers."""


@torch.library.custom_op("meshfold::constant", mutates_args=())
def constant(ints: Sequence[int], floats: Sequence[float], shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` holding ``ints`` (integer and bool dtypes) or ``floats``."""
    check_literal(ints, floats, shape, dtype)
    values = list(ints) if not dtype.is_floating_point and not dtype.is_complex else list(floats)
    return torch.tensor(values, dtype=dtype).reshape(tuple(shape))


@constant.register_fake
def _constant_fake(
    ints: Sequence[int], floats: Sequence[float], shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    check_literal(ints, floats, shape, dtype)
    return torch.empty(tuple(shape), dtype=dtype)


def check_literal(ints: Sequence[int], floats: Sequence[float], shape: Sequence[int], dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless the literal holds exactly ``prod(shape)`` values of the kind
    ``dtype`` takes (ints for integer and bool dtypes, floats otherwise) and no more than
    ``MAX_ELEMENTS``."""
    if any(d < 0 for d in shape):
        raise ValueError(f"constant of shape {list(shape)}: sizes must be >= 0")
    n = 1
    for d in shape:
        n *= d
    if n > MAX_ELEMENTS:
        raise ValueError(f"constant of shape {list(shape)} has {n} elements; at most {MAX_ELEMENTS} are a literal")
    floating = dtype.is_floating_point or dtype.is_complex
    given, other = (floats, ints) if floating else (ints, floats)
    kind = "floats" if floating else "ints"
    if len(other) or len(given) != n:
        raise ValueError(
            f"constant of shape {list(shape)} and dtype {dtype} needs {n} {kind}; it holds "
            f"{len(ints)} ints and {len(floats)} floats"
        )


def literal(t: torch.Tensor) -> tuple[list[int], list[float], list[int], torch.dtype]:
    """``meshfold.constant``'s arguments for real tensor ``t``; raises ``ValueError`` when ``t`` is too
    large to be a literal."""
    shape = list(t.shape)
    if t.dtype.is_complex:
        raise ValueError("a complex tensor constant has no literal form; register it as a buffer")
    if t.numel() > MAX_ELEMENTS:
        raise ValueError(f"a tensor of shape {shape} has {t.numel()} elements; at most {MAX_ELEMENTS} are a literal")
    flat = t.detach().reshape(-1).tolist()
    if t.dtype.is_floating_point:
        return [], [float(v) for v in flat], shape, t.dtype
    return [int(v) for v in flat], [], shape, t.dtype


CONSTANT = torch.ops.meshfold.constant.default
