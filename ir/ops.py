"""Op targets: ATen/custom ``OpOverload``s, plus meshfold's own ``comm.*`` and ``mem.*`` ops.

Our own ops are declared here as plain data (``OpDef``); backends lower them later. Each collective
carries its meaning once: how it changes a layout on its mesh axis (:meth:`OpDef.moves`,
:meth:`OpDef.transfer`) and how many bytes a rank sends for it (:meth:`OpDef.wire_bytes`).
Which ATen ops are views is answered by :func:`view_trait` alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch._ops import OpOverload

from meshfold.ir.memo import Kept, by_identity
from meshfold.ir.mesh import Mesh
from meshfold.ir.placement import Layout, Partial, Placement, ReduceOp, Replicate, Shard
from meshfold.ir.symbolic import size_hint
from meshfold.ir.types import TensorType

if TYPE_CHECKING:
    from meshfold.ir.graph import Op

Attrs = Mapping[str, object]
"""An op's attributes by name (``dict(op.kwargs)``): ``axis``, ``dim``, ``reduce``, ..."""

MoveFn = Callable[[Attrs, int], tuple[Placement, Placement]]
"""Given a collective's attributes and an operand index, (operand placement, result placement) on
the collective's own mesh axis."""

VolumeFn = Callable[[float, int], float]
"""Given the bytes one operand holds on one rank and the axis size ``n``, bytes that rank sends."""


@dataclass(frozen=True, slots=True, eq=False)
class OpDef:
    """One of meshfold's own ops: ``namespace.name`` with named attributes and a contract.

    Declared once per name, so equal only to itself (a program compares and hashes op targets
    millions of times); copies and pickles resolve to the declared op.

    ``keeps_value``: the op changes only how or where ranks hold a value, never the global value
    (every ``comm.*`` and ``mem.*`` op but ``comm.ppermute``, which moves pieces of a split dim
    between ranks: ``permuted``), so on whole tensors it is the identity. ``move``/``volume``: a
    collective's layout transfer and wire volume (None for ops without a fixed one:
    ``comm.redistribute``, ``comm.wait``, ``mem.*``).
    """

    namespace: str
    name: str
    attrs: tuple[str, ...]
    doc: str
    pure: bool = True
    keeps_value: bool = False
    move: MoveFn | None = None
    volume: VolumeFn | None = None

    @property
    def qualname(self) -> str:
        return f"{self.namespace}.{self.name}"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _declared, (self.qualname,)

    def moves(self, attrs: Attrs, operand: int = 0) -> tuple[Placement, Placement]:
        """(operand placement, result placement) of operand ``operand`` (its result is the one at
        the same index) on the mesh axis ``attrs["axis"]``; every other axis keeps its placement.
        Raises ``ValueError`` for an op without a fixed layout transfer."""
        if self.move is None:
            raise ValueError(f"{self.qualname} has no fixed layout transfer")
        return self.move(attrs, operand)

    def transfer(self, layout: Layout, attrs: Attrs, operand: int = 0) -> Layout:
        """The layout of result ``operand`` when operand ``operand`` is held in ``layout``. Raises
        ``ValueError`` when ``layout`` does not have the placement the op consumes on its axis."""
        axis = str(attrs["axis"])
        src, dst = self.moves(attrs, operand)
        if layout.placement(axis) != src:
            raise ValueError(f"{self.qualname} over {axis!r} takes {src} there, but the operand is {layout}")
        return layout.with_placement(axis, dst)

    def wire_bytes(self, local_bytes: float, n: int) -> float:
        """Bytes one rank sends (ring algorithms) for one operand of ``local_bytes`` on that rank
        over an axis of ``n`` ranks: all_gather ``b(n-1)``, all_reduce ``2b(n-1)/n``, reduce_scatter
        and all_to_all ``b(n-1)/n`` (buckets: per operand, as their base collective); 0 for local
        ops (shard, partial) and ops without a volume."""
        return 0.0 if self.volume is None else self.volume(local_bytes, n)

    def wire_bytes_of(self, global_type: TensorType, layout: Layout, mesh: Mesh, attrs: Attrs) -> float:
        """:meth:`wire_bytes` for one operand of ``global_type`` held in ``layout`` on ``mesh``
        (the collective's axis is ``attrs["axis"]``; the split must be even, see ``Layout.local_shape``)."""
        if self.volume is None:
            return 0.0
        local = size_hint(math.prod(layout.local_shape(global_type.shape, mesh))) * global_type.dtype.itemsize
        return self.wire_bytes(float(local), mesh.size(str(attrs["axis"])))

    def __str__(self) -> str:
        return self.qualname


Target = OpOverload | OpDef

_OWN: dict[str, OpDef] = {}


def _declared(qualname: str) -> OpDef:
    return _OWN[qualname]


def _declare(
    namespace: str,
    name: str,
    attrs: tuple[str, ...],
    doc: str,
    pure: bool = True,
    move: MoveFn | None = None,
    volume: VolumeFn | None = None,
    keeps_value: bool | None = None,
) -> OpDef:
    keeps = namespace in ("comm", "mem") if keeps_value is None else keeps_value
    op = OpDef(namespace, name, attrs, doc, pure, keeps, move, volume)
    _OWN[op.qualname] = op
    return op


def _dim(attrs: Attrs, key: str, operand: int) -> int:
    """``attrs[key]`` as a dim; for a bucket (``dims``), operand ``operand``'s entry."""
    if "dims" in attrs:
        dims = attrs["dims"]
        assert isinstance(dims, tuple | list), f"dims must be a sequence, got {dims!r}"
        return int(dims[operand])
    return int(cast(int, attrs[key]))


def _reduce(attrs: Attrs) -> ReduceOp:
    return cast(ReduceOp, attrs.get("reduce", "sum"))


def _gather(a: Attrs, k: int) -> tuple[Placement, Placement]:
    return Shard(_dim(a, "dim", k)), Replicate()


def _reduce_scatter(a: Attrs, k: int) -> tuple[Placement, Placement]:
    return Partial(_reduce(a)), Shard(_dim(a, "dim", k))


def _all_reduce(a: Attrs, k: int) -> tuple[Placement, Placement]:
    return Partial(_reduce(a)), Replicate()


def _all_to_all(a: Attrs, k: int) -> tuple[Placement, Placement]:
    return Shard(_dim(a, "concat_dim", k)), Shard(_dim(a, "split_dim", k))


def _shard(a: Attrs, k: int) -> tuple[Placement, Placement]:
    return Replicate(), Shard(_dim(a, "dim", k))


def _partial(a: Attrs, k: int) -> tuple[Placement, Placement]:
    return Replicate(), Partial(_reduce(a))


def _permute(a: Attrs, k: int) -> tuple[Placement, Placement]:
    return Shard(_dim(a, "dim", k)), Shard(_dim(a, "dim", k))


def _sent_volume(b: float, n: int) -> float:
    return b


def _gather_volume(b: float, n: int) -> float:
    return b * (n - 1)


def _all_reduce_volume(b: float, n: int) -> float:
    return 2 * b * ((n - 1) / n)


def _scatter_volume(b: float, n: int) -> float:
    return b * ((n - 1) / n)


# NOTE: collectives take the mesh axis by name. Types stay GLOBAL shapes throughout the IR; a
# value's layout says how ranks hold it, and backends derive local shapes from the two.
ALL_GATHER = _declare(
    "comm", "all_gather", ("axis", "dim"), "concatenate shards along dim over axis", True, _gather, _gather_volume
)
REDUCE_SCATTER = _declare(
    "comm",
    "reduce_scatter",
    ("axis", "dim", "reduce"),
    "reduce partials over axis, keep this rank's dim shard",
    True,
    _reduce_scatter,
    _scatter_volume,
)
ALL_REDUCE = _declare(
    "comm",
    "all_reduce",
    ("axis", "reduce"),
    "reduce partials over axis, every rank gets all",
    True,
    _all_reduce,
    _all_reduce_volume,
)
ALL_TO_ALL = _declare(
    "comm",
    "all_to_all",
    ("axis", "split_dim", "concat_dim"),
    "re-shard from concat_dim to split_dim over axis",
    True,
    _all_to_all,
    _scatter_volume,
)
ALL_GATHER_BUCKET = _declare(
    "comm",
    "all_gather_bucket",
    ("axis", "dims"),
    "all_gather of every operand (operand i along dims[i]) over axis as ONE collective on a flat buffer",
    True,
    _gather,
    _gather_volume,
)
REDUCE_SCATTER_BUCKET = _declare(
    "comm",
    "reduce_scatter_bucket",
    ("axis", "dims", "reduce"),
    "reduce_scatter of every operand (operand i along dims[i]) over axis as ONE collective on a flat buffer",
    True,
    _reduce_scatter,
    _scatter_volume,
)
ALL_REDUCE_BUCKET = _declare(
    "comm", "all_reduce_bucket", ("axis", "reduce"),
    "all_reduce of every operand over axis as ONE collective on a flat buffer", True, _all_reduce, _all_reduce_volume,
)  # fmt: skip
PPERMUTE = _declare(
    "comm",
    "ppermute",
    ("axis", "dim", "order"),
    "pieces of dim (split over axis) moved between ranks: the result's piece j is the operand's piece order[j]",
    True,
    _permute,
    _sent_volume,
    keeps_value=False,
)
WAIT = _declare("comm", "wait", (), "wait for an asynchronous collective's (or reload's) result")
REDISTRIBUTE = _declare(
    "comm", "redistribute", (), "the operand in the result's layout; boxing lowers it to collectives"
)
SHARD = _declare(
    "comm",
    "shard",
    ("axis", "dim"),
    "keep this rank's chunk of dim along axis (no communication)",
    True,
    _shard,
)
PARTIAL = _declare(
    "comm",
    "partial",
    ("axis", "reduce"),
    "a Replicate value as Partial along axis (sum: zero on all but one rank)",
    True,
    _partial,
)
OFFLOAD = _declare("mem", "offload", (), "copy an activation to host memory (on CPU ranks: a file)", pure=False)
RELOAD = _declare("mem", "reload", (), "copy an offloaded activation back to device memory", pure=False)


def collective_for(src: Placement, dst: Placement) -> tuple[OpDef, tuple[tuple[str, object], ...]]:
    """The one comm op that takes ``src`` to ``dst`` on one mesh axis, with its attributes other
    than ``axis`` (sorted by name): ``S(d)→R`` all_gather(dim=d), ``P→R`` all_reduce(reduce),
    ``P→S(d)`` reduce_scatter(dim=d, reduce), ``S(d)→S(e)`` all_to_all(concat_dim=d, split_dim=e),
    ``R→S(d)`` shard(dim=d), ``R→P`` partial(reduce). Raises ``ValueError`` when ``src == dst`` or
    no single op does it (``S→P`` is a gather then a partial; ``P(a)→P(b)`` a reduce then a partial)."""
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return ALL_GATHER, (("dim", src.dim),)
    if isinstance(src, Shard) and isinstance(dst, Shard) and src != dst:
        return ALL_TO_ALL, (("concat_dim", src.dim), ("split_dim", dst.dim))
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return ALL_REDUCE, (("reduce", src.reduce),)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return REDUCE_SCATTER, (("dim", dst.dim), ("reduce", src.reduce))
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return SHARD, (("dim", dst.dim),)
    if isinstance(src, Replicate) and isinstance(dst, Partial):
        return PARTIAL, (("reduce", dst.reduce),)
    raise ValueError(f"no single collective takes {src} to {dst} on one mesh axis")


@dataclass(frozen=True, slots=True)
class ViewTrait:
    """How a view's result relates to its first operand (its base), whose storage it shares.

    ``reshape``: the result is the base's elements in row-major order under a new shape (``view``,
    ``_unsafe_view``, ``reshape``, ``unflatten``). ``strided``: the op is valid only on strides like
    the traced ones (``view``, ``_unsafe_view``); on real tensors it runs as ``aten.reshape``.
    """

    reshape: bool = False
    strided: bool = False


_aten = torch.ops.aten
_STRIDED = frozenset({_aten.view.default, _aten._unsafe_view.default})
_RESHAPES = _STRIDED | {_aten.reshape.default, _aten.unflatten.int}


def view_trait(target: Target) -> ViewTrait | None:
    """The view trait of ``target``, or None when its result owns new storage.

    A view is an ATen op whose schema marks every return as a non-writing alias of an input
    (``view``, ``t``, ``transpose``, ``permute``, ``expand``, ``slice``, ``reshape``, ``alias``, ...),
    or ``_unsafe_view`` (a view the schema does not mark). Our own ops are never views.
    """
    if isinstance(target, OpDef):
        return None
    if target not in _STRIDED:
        returns = target._schema.returns
        if not returns or any(r.alias_info is None or r.alias_info.is_write for r in returns):
            return None
    return ViewTrait(reshape=target in _RESHAPES, strided=target in _STRIDED)


def is_view(target: Target) -> bool:
    """Whether ``target``'s result shares its first operand's storage (see :func:`view_trait`)."""
    return view_trait(target) is not None


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


def draws(op: Op) -> bool:
    """Whether ``op`` draws from a generator: ATen tags such ops ``nondeterministic_seeded``, and
    attention with ``dropout_p=0`` draws nothing."""
    target = op.target
    if isinstance(target, OpDef) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" in names:
        at = names.index("dropout_p")
        p = op.args[at] if at < len(op.args) else op.kwarg("dropout_p", 0.0)
        return p not in (0, 0.0, None)
    return True


def is_pure(target: Target) -> bool:
    """True when removing or merging calls of ``target`` cannot change results (no mutation, no RNG)."""
    if isinstance(target, OpDef):
        return target.pure
    return by_identity(_PURE, target, _aten_pure)


def _aten_pure(target: OpOverload) -> bool:
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


_PURE: Kept[OpOverload, bool] = {}
"""``is_pure`` of each ATen overload asked about (every pass asks for each op)."""
