"""The matrix's columns: every plan family on four ranks, as ``parallelize`` takes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshfold.tools.corpus.catalog import Entry

WORLD = 4
"""Ranks every column runs on."""


@dataclass(frozen=True)
class Column:
    """One plan family's cell recipe: the mesh (axis names and sizes), ``plan`` and the keywords
    that select the family's feature (``memory=``, ``cp=``, ``pp=``, ``moe=``, ``backend=``).
    ``needs``: the traits an entry must have for the family to apply (else the cell is ``n/a``)."""

    name: str
    family: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    plan: str
    options: tuple[tuple[str, Any], ...] = ()
    needs: frozenset[str] = field(default_factory=frozenset)

    @property
    def pipelined(self) -> bool:
        return any(k == "pp" for k, _ in self.options)

    def applies(self, entry: Entry) -> bool:
        return self.needs <= entry.traits

    def kwargs(self) -> dict[str, Any]:
        """``parallelize``'s keywords besides the model, mesh and inputs."""
        return {"plan": self.plan, **{k: dict(v) if isinstance(v, tuple) else v for k, v in self.options}}

    @property
    def mesh(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.shape, strict=True))


def _pp(schedule: str, rest: str, **extra: Any) -> Column:
    """``pp=2`` beside ``rest`` (``ddp``, ``fsdp`` or ``tp``) on two ranks, two microbatches."""
    axis = "tp" if rest == "tp" else "dp"
    spec = (("schedule", schedule), ("microbatches", 2), *extra.items())
    deep = frozenset({"stack", "deep"}) if schedule == "interleaved" else frozenset({"stack"})
    return Column(f"pp-{schedule}-{rest}", "pp", ("pp", axis), (2, 2), f"pp+{rest}", (("pp", spec),), deep)


SEQUENCE = frozenset({"attention", "tokens"})
"""What context parallelism needs: attention over a sequence the inputs hold (the ``cp`` preset splits
each input's dim 1; an image's tokens are made inside the model)."""

COLUMNS: tuple[Column, ...] = (
    Column("ddp", "ddp", ("dp",), (4,), "ddp"),
    Column("fsdp", "fsdp", ("dp",), (4,), "fsdp"),
    Column("tp", "tp", ("tp",), (4,), "tp"),
    Column("fsdp+tp", "fsdp+tp", ("dp", "tp"), (2, 2), "fsdp+tp"),
    Column("auto", "auto", ("dp", "tp"), (2, 2), "auto"),
    Column("mem-full", "memory", ("dp", "tp"), (2, 2), "fsdp+tp", (("memory", "full"),)),
    Column("mem-selective", "memory", ("dp", "tp"), (2, 2), "fsdp+tp", (("memory", "selective"),)),
    Column("mem-kv", "memory", ("dp", "tp"), (2, 2), "fsdp+tp", (("memory", "kv"),), frozenset({"attention"})),
    Column("mem-offload", "memory", ("dp", "tp"), (2, 2), "fsdp+tp", (("memory", "offload"),)),
    Column("cp-ring", "cp", ("dp", "cp"), (2, 2), "fsdp+cp", (("cp", "ring"),), SEQUENCE),
    Column("cp-tokenring", "cp", ("dp", "cp"), (2, 2), "fsdp+cp", (("cp", "tokenring"),), SEQUENCE),
    Column("cp-ulysses", "cp", ("dp", "cp"), (2, 2), "fsdp+cp", (("cp", "ulysses"),), SEQUENCE),
    _pp("gpipe", "ddp"),
    _pp("1f1b", "fsdp"),
    _pp("1f1b", "tp"),
    _pp("interleaved", "fsdp"),
    _pp("zero-bubble", "ddp"),
    _pp("zero-bubble", "tp"),
    Column("ep", "ep", ("dp", "tp"), (2, 2), "fsdp+tp", (("moe", (("ep", 4),)),), frozenset({"moe"})),
    Column("inductor", "inductor", ("dp", "tp"), (2, 2), "fsdp+tp", (("backend", "inductor"),)),
)
"""Every column of the matrix, in its order."""

FAMILIES = tuple(dict.fromkeys(c.family for c in COLUMNS))


def column(name: str) -> Column:
    for c in COLUMNS:
        if c.name == name:
            return c
    raise ValueError(f"unknown corpus column {name!r}; known: {', '.join(c.name for c in COLUMNS)}")
