"""Results of ATen ops on meta tensors, kept by what decides them.

The layer record (``meshfold.tracing.layer_runs``) runs every layer of a deep model on meta tensors, and the
layers of a stack run the same ops on the same shapes: after the first layer, each pure op's meta
kernel would compute what it computed before (the kernels of pointwise ops are Python references,
most of a layer's record). ``MetaResults.call`` runs an op once per key and afterwards hands out
blank meta tensors of the shapes, strides and dtypes it returned.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch

Spec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
"""A meta tensor's shape, strides and dtype."""

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
"""The symbolic scalar types (a size or value the shape environment tracks)."""


def leaves(x: Any, into: list[Any] | None = None) -> list[Any]:
    """The leaves of an ATen op's arguments or results (tuples, lists and dicts of them), in
    ``tree_flatten``'s order; a plain walk, as every op of a recorded forward is flattened."""
    out: list[Any] = [] if into is None else into
    for y in x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else (x,):
        if isinstance(y, (tuple, list, dict)):
            leaves(y, out)
        else:
            out.append(y)
    return out


class MetaResults:
    """Ops run on meta tensors, each pure op's kernel once per key (``key``)."""

    def __init__(self) -> None:
        self.seen: dict[Hashable, tuple[bool, tuple[Spec, ...]]] = {}
        self.reused = 0
        """Calls answered from ``seen``."""

    def call(self, func: Any, args: Any, kwargs: dict[str, Any], flat: list[Any] | None = None) -> Any:
        """``func(*args, **kwargs)``, or blank tensors of what the same call returned before. ``flat``:
        ``leaves((args, kwargs))`` where the caller has them already."""
        key = self.key(func, args, kwargs, flat)
        got = None if key is None else self.seen.get(key)
        if got is None:
            out = func(*args, **kwargs)
            specs = _specs(out) if key is not None else None
            if specs is not None:
                self.seen[key] = (isinstance(out, torch.Tensor), specs)
            return out
        self.reused += 1
        single, specs = got
        made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in specs]
        return made[0] if single else tuple(made)

    @staticmethod
    def key(func: Any, args: Any, kwargs: dict[str, Any], flat: list[Any] | None = None) -> Hashable | None:
        """What decides a pure op's results on meta tensors: the op, the names of its keyword
        arguments, each tensor's shape, strides, offset and dtype, each other argument with its type
        (``2`` and ``2.0`` promote differently). None for an op that writes or aliases its operands
        (its results are not fresh tensors), or that reads a tensor off meta or a symbolic size; None
        too for what has no schema (a higher-order operator). The default dtype is part of the key
        (a factory op given no dtype makes one of it)."""
        if not _fresh_results(func):
            return None
        key: list[Hashable] = [func, tuple(kwargs), torch.get_default_dtype()]
        for x in leaves((args, kwargs)) if flat is None else flat:
            if isinstance(x, torch.Tensor):
                if x.device.type != "meta" or x.layout != torch.strided:
                    return None
                shape, stride = tuple(x.shape), x.stride()
                if any(isinstance(d, SYMBOLIC) for d in (*shape, *stride)):
                    return None
                key.append((shape, stride, x.storage_offset(), x.dtype))
            elif isinstance(x, SYMBOLIC) or not isinstance(x, Hashable):
                return None
            else:
                key.append((type(x), x))
        return tuple(key)


@functools.cache
def _fresh_results(func: Any) -> bool:
    """Whether ``func`` has a schema, writes none of its operands and returns none of them (asked
    at every op of a recorded forward, of a few dozen ops)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def _specs(out: Any) -> tuple[Spec, ...] | None:
    """An op's results as specs when they are one fresh meta tensor or a tuple of them; else None."""
    outs = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, tuple) else None
    if not outs or not all(
        isinstance(t, torch.Tensor) and t.device.type == "meta" and t.storage_offset() == 0 for t in outs
    ):
        return None
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in outs)
