"""Op targets: ATen/custom ``OpOverload``s, plus meshfold's own ``comm.*`` and ``mem.*`` ops.

Our own ops are declared here as plain data (``OpDef``); backends lower them later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._ops import OpOverload


@dataclass(frozen=True, slots=True)
class OpDef:
    """One of meshfold's own ops: ``namespace.name`` with named attributes and a contract."""

    namespace: str
    name: str
    attrs: tuple[str, ...]
    doc: str
    pure: bool = True

    @property
    def qualname(self) -> str:
        return f"{self.namespace}.{self.name}"

    def __str__(self) -> str:
        return self.qualname


Target = OpOverload | OpDef

_OWN: dict[str, OpDef] = {}


def _declare(namespace: str, name: str, attrs: tuple[str, ...], doc: str, pure: bool = True) -> OpDef:
    op = OpDef(namespace, name, attrs, doc, pure)
    _OWN[op.qualname] = op
    return op


# NOTE: collectives take the mesh axis by name. Types stay GLOBAL shapes throughout the IR; a
# value's layout says how ranks hold it, and backends derive local shapes from the two.
ALL_GATHER = _declare("comm", "all_gather", ("axis", "dim"), "concatenate shards along dim over axis")
REDUCE_SCATTER = _declare(
    "comm", "reduce_scatter", ("axis", "dim", "reduce"), "reduce partials over axis, keep this rank's dim shard"
)
ALL_REDUCE = _declare("comm", "all_reduce", ("axis", "reduce"), "reduce partials over axis, every rank gets all")
ALL_TO_ALL = _declare(
    "comm", "all_to_all", ("axis", "split_dim", "concat_dim"), "re-shard from concat_dim to split_dim over axis"
)
ALL_GATHER_BUCKET = _declare(
    "comm",
    "all_gather_bucket",
    ("axis", "dims"),
    "all_gather of every operand (operand i along dims[i]) over axis as ONE collective on a flat buffer",
)
REDUCE_SCATTER_BUCKET = _declare(
    "comm",
    "reduce_scatter_bucket",
    ("axis", "dims", "reduce"),
    "reduce_scatter of every operand (operand i along dims[i]) over axis as ONE collective on a flat buffer",
)
PPERMUTE = _declare("comm", "ppermute", ("axis", "perm"), "send to the peer given by perm along axis")
WAIT = _declare("comm", "wait", (), "wait for an asynchronous collective's result")
REDISTRIBUTE = _declare(
    "comm", "redistribute", (), "the operand in the result's layout; boxing lowers it to collectives"
)
SHARD = _declare("comm", "shard", ("axis", "dim"), "keep this rank's chunk of dim along axis (no communication)")
PARTIAL = _declare(
    "comm", "partial", ("axis", "reduce"), "a Replicate value as Partial along axis (sum: zero on all but one rank)"
)
OFFLOAD = _declare("mem", "offload", (), "copy an activation to host memory", pure=False)
RELOAD = _declare("mem", "reload", (), "copy an offloaded activation back to device memory", pure=False)


def own_ops() -> dict[str, OpDef]:
    """All of meshfold's own ops by qualified name."""
    return dict(_OWN)


def target_name(target: Target) -> str:
    """Text name: ``aten.mm`` for a default overload, ``aten.add.Tensor`` otherwise, ``comm.all_gather``."""
    if isinstance(target, OpDef):
        return target.qualname
    ns = target.namespace
    packet = target._opname
    overload = target._overloadname
    return f"{ns}.{packet}" if overload == "default" else f"{ns}.{packet}.{overload}"


def resolve_target(name: str) -> Target:
    """Inverse of :func:`target_name`, by attribute lookup on ``torch.ops`` (never ``eval``)."""
    if name in _OWN:
        return _OWN[name]
    parts = name.split(".")
    if len(parts) not in (2, 3) or not all(p.isidentifier() for p in parts):
        raise ValueError(f"{name!r} is not an op name; expected ns.op or ns.op.overload")
    ns, packet = parts[0], parts[1]
    overload = parts[2] if len(parts) == 3 else "default"
    try:
        op = getattr(getattr(getattr(torch.ops, ns), packet), overload)
    except (AttributeError, RuntimeError):
        raise ValueError(
            f"unknown op {name!r}: torch.ops.{ns}.{packet}.{overload} is not registered "
            "(import the library that defines it first)"
        ) from None
    if not isinstance(op, OpOverload):
        raise ValueError(f"{name!r} resolves to {type(op).__name__}, not an op overload")
    return op


def is_pure(target: Target) -> bool:
    """True when removing or merging calls of ``target`` cannot change results (no mutation, no RNG)."""
    if isinstance(target, OpDef):
        return target.pure
    if target._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags
