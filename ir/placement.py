"""Placements (Shard / Replicate / Partial) and layouts: descriptions only, they never communicate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import torch

from meshfold.ir.mesh import Mesh
from meshfold.ir.symbolic import Dim, divides
from meshfold.ir.types import is_float8

ReduceOp = Literal["sum", "max", "avg"]
REDUCE_OPS: tuple[ReduceOp, ...] = ("sum", "max", "avg")


def reduce_refusal(reduce: str, dtype: torch.dtype) -> str | None:
    """Why a reduction ``reduce`` (a ``Partial``'s, a ``comm.*`` op's ``reduce``) of ``dtype`` values
    means nothing, or None when it means what it says: ``sum`` adds (a sum of bools is no bool), ``avg``
    divides (only floating-point and complex values hold a mean), ``max`` orders (complex numbers have
    no order; torch.distributed refuses them too). Every other reduction of every dtype is allowed:
    collectives that only move values (gathers, all-to-alls, permutes) take any dtype."""
    if reduce == "max" and dtype.is_complex:
        return "complex numbers have no order, so their max means nothing; reduce their abs() instead"
    if reduce == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        return "a mean of integers or bools is no integer or bool; sum them and divide in floating point"
    if reduce == "sum" and dtype == torch.bool:
        return "a sum of bools is no bool; sum them as integers, or reduce with max (any)"
    if is_float8(dtype):
        return "collectives do not reduce float8 values (nor NCCL nor gloo); reduce them in bf16 or fp32"
    return None


@dataclass(frozen=True, slots=True)
class Shard:
    """The tensor is split along ``dim`` across the mesh axis."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every rank along the mesh axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    """Every rank holds a partial value; the full value is their reduction with ``reduce``."""

    reduce: ReduceOp = "sum"

    def __str__(self) -> str:
        return f"P({self.reduce})"


Placement = Shard | Replicate | Partial

R = Replicate()


def parse_placement(text: str) -> Placement:
    """Parse ``S(0)``, ``R`` or ``P(sum)`` (also ``P`` meaning ``P(sum)``)."""
    t = text.strip()
    if t == "R":
        return R
    if t == "P":
        return Partial()
    if t.startswith("S(") and t.endswith(")") and t[2:-1].strip().isdigit():
        return Shard(int(t[2:-1]))
    if t.startswith("P(") and t.endswith(")"):
        red = t[2:-1].strip()
        for op in REDUCE_OPS:
            if red == op:
                return Partial(op)
    raise ValueError(f"unknown placement {text!r}; expected S(<dim>), R, P or P(sum|max|avg)")


@dataclass(frozen=True, slots=True)
class Layout:
    """One placement per mesh axis, in the mesh's axis order. The empty layout means 'no mesh'."""

    axes: tuple[str, ...] = ()
    placements: tuple[Placement, ...] = ()

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.placements):
            raise ValueError(f"layout has {len(self.axes)} axes but {len(self.placements)} placements")

    @staticmethod
    def replicated(mesh: Mesh | None) -> Layout:
        """The all-Replicate layout on ``mesh`` (the empty layout when there is no mesh)."""
        if mesh is None:
            return Layout()
        return Layout(mesh.names, tuple(R for _ in mesh.names))

    @staticmethod
    def on(mesh: Mesh, **placements: Placement) -> Layout:
        """Layout on ``mesh`` with the given axes placed and every other axis Replicate."""
        for axis in placements:
            mesh.index(axis)
        return Layout(mesh.names, tuple(placements.get(n, R) for n in mesh.names))

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def placement(self, axis: str) -> Placement:
        return self.placements[self.axes.index(axis)]

    def with_placement(self, axis: str, placement: Placement) -> Layout:
        i = self.axes.index(axis)
        return Layout(self.axes, (*self.placements[:i], placement, *self.placements[i + 1 :]))

    def shard_bounds(
        self, global_shape: Sequence[Dim], mesh: Mesh, coord: Sequence[int] | None = None
    ) -> tuple[tuple[Any, Any], ...]:
        """``(offset, size)`` on every dim of the shard that the rank at mesh coordinate ``coord``
        (one index per mesh axis, in mesh order; None: the first rank) holds of a value of
        ``global_shape`` in this layout.

        Replicate and Partial axes keep whole dims (a Partial rank holds a full-shape addend). A dim
        sharded over several mesh axes is split outer axis first: each axis cuts the piece the axes
        before it left into equal contiguous chunks and the rank keeps chunk ``coord[axis]`` (so
        ``torch.chunk`` applied per axis in mesh order gives the same piece). Raises ``ValueError``
        when a split is uneven (the sharding passes only choose dividing shards; JAX's
        ``shard_shape`` refuses them too); symbolic sizes give symbolic bounds.
        """
        shape = tuple(global_shape)
        return _bounds(self, shape, mesh, tuple(0 for _ in mesh.names) if coord is None else tuple(coord))

    def local_shape(
        self, global_shape: Sequence[Dim], mesh: Mesh, coord: Sequence[int] | None = None
    ) -> tuple[Any, ...]:
        """The shape one rank holds of a value of ``global_shape`` in this layout: the sizes of
        :meth:`shard_bounds` (even splits, so every coordinate gets the same shape)."""
        return tuple(size for _, size in self.shard_bounds(global_shape, mesh, coord))

    def __str__(self) -> str:
        inner = ", ".join(
            f"{a}: {p}" for a, p in zip(self.axes, self.placements, strict=True) if not isinstance(p, Replicate)
        )
        return "{" + inner + "}"


@lru_cache(maxsize=65536)
def _bounds(layout: Layout, shape: tuple[Dim, ...], mesh: Mesh, at: tuple[int, ...]) -> tuple[tuple[Any, Any], ...]:
    """``Layout.shard_bounds``, kept per layout, shape, mesh and coordinate: every layer of a stack
    asks for the same few (a 70B model's pipeline asks about fifty thousand times)."""
    # NOTE: a symbolic size stays symbolic; it splits only where every value of it divides (``divides``).
    bounds: list[list[Any]] = [[0, d] for d in shape]
    for axis, p in zip(layout.axes, layout.placements, strict=True):
        if not isinstance(p, Shard):
            continue
        n = mesh.size(axis)
        size = bounds[p.dim][1]
        if not divides(size, n) and size != 0:
            raise ValueError(
                f"dim {p.dim} (size {size}) of shape {shape} does not divide over mesh axis "
                f"{axis!r} ({n} ranks) in layout {layout}"
            )
        bounds[p.dim][1] = size // n
        bounds[p.dim][0] += at[mesh.index(axis)] * (size // n)
    return tuple((lo, size) for lo, size in bounds)
