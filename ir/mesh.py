"""Named device meshes: plain data describing how ranks are arranged, never a process group."""

from __future__ import annotations

import re
from dataclasses import dataclass

_AXIS_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class Mesh:
    """An N-D arrangement of ranks with one name per axis, e.g. ``mesh<dp=2, tp=4>``."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes):
            raise ValueError(f"mesh has {len(self.names)} axis names but {len(self.sizes)} sizes")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh axis names must be distinct, got {self.names}")
        for name, size in zip(self.names, self.sizes, strict=True):
            if not _AXIS_RE.match(name):
                raise ValueError(f"mesh axis name {name!r} is not an identifier")
            if size < 1:
                raise ValueError(f"mesh axis {name!r} has size {size}; sizes must be >= 1")

    @staticmethod
    def of(**axes: int) -> Mesh:
        """Build a mesh from keyword axes in order: ``Mesh.of(dp=2, tp=2)``."""
        return Mesh(tuple(axes), tuple(axes.values()))

    @staticmethod
    def parse(text: str) -> Mesh:
        """Parse ``"dp=2,tp=2"`` or ``"mesh<dp=2, tp=2>"`` into a mesh."""
        body = text.strip()
        if body.startswith("mesh<") and body.endswith(">"):
            body = body[5:-1]
        names: list[str] = []
        sizes: list[int] = []
        for item in filter(None, (p.strip() for p in body.split(","))):
            name, sep, size = item.partition("=")
            if not sep or not size.strip().isdigit():
                raise ValueError(f"mesh axis {item!r} must look like NAME=SIZE, e.g. dp=2")
            names.append(name.strip())
            sizes.append(int(size))
        if not names:
            raise ValueError(f"mesh {text!r} has no axes; write e.g. dp=2,tp=2")
        return Mesh(tuple(names), tuple(sizes))

    @property
    def ndim(self) -> int:
        return len(self.names)

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def size(self, axis: str) -> int:
        """Size of the named axis; raises naming the known axes when it is missing."""
        return self.sizes[self.index(axis)]

    def index(self, axis: str) -> int:
        try:
            return self.names.index(axis)
        except ValueError:
            raise KeyError(f"mesh {self} has no axis {axis!r}; its axes are {list(self.names)}") from None

    def __str__(self) -> str:
        inner = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))
        return f"mesh<{inner}>"
