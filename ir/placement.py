"""Placements (Shard / Replicate / Partial) and layouts: descriptions only, they never communicate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshfold.ir.mesh import Mesh

ReduceOp = Literal["sum", "max", "avg"]
REDUCE_OPS: tuple[ReduceOp, ...] = ("sum", "max", "avg")


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

    def __str__(self) -> str:
        inner = ", ".join(
            f"{a}: {p}" for a, p in zip(self.axes, self.placements, strict=True) if not isinstance(p, Replicate)
        )
        return "{" + inner + "}"
