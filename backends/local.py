"""How one rank computes an op on its shard: argument localizers and ranged implementations.

Sharding rules (``passes/sharding/rules``) say which layouts an op accepts; this table says what a
rank then runs. Most ops run unchanged on local tensors. Two kinds do not:

* an op whose arguments spell a shape (``view``'s size, ``full``'s size) gets them rewritten to the
  local shape by its **localizer**;
* an op whose indexed dim is sharded (vocab-parallel embedding, gather/scatter along a sharded dim,
  expert-parallel routed experts) runs a **ranged** implementation that knows which slice
  ``[lo, lo + size)`` of that dim this rank holds and masks the indices outside it.

One decorator each, per family: ``LOCAL.shape_arg``, ``LOCAL.localizer``, ``LOCAL.ranged``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from meshfold.backends.experts.ranged import EXPERTS_RANGE, EXPERTS_RANGE_BACKWARD
from meshfold.ir import Layout, Mesh, Op, Shard, Target, TensorType
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.passes.sharding.rules.operands import int_arg, norm_dim

aten = torch.ops.aten

LocalizeFn = Callable[[Op, tuple[tuple[int, ...], ...]], tuple[tuple[Any, ...], dict[str, Any]]]
"""Given an op and its results' LOCAL shapes, the args and kwargs to call it with on one rank."""

Where = Callable[[Op], tuple[str, int, int]]
"""The indexed tensor of a ranged op: ``("operand", i, dim)`` or ``("result", i, dim)``."""


@dataclass(frozen=True)
class Ranged:
    """An op whose local form depends on which slice ``[lo, lo + size)`` of an indexed dim this rank
    holds: out-of-range indices are masked. ``where(op)`` names the indexed tensor;
    ``impl(lo, size, *args, **kwargs)`` computes the op on one rank's shard (a module-level function,
    so lowered fx graphs can call it)."""

    where: Where
    impl: Callable[..., Any]


@dataclass
class LocalForms:
    """Localizers and ranged implementations by target, registered with the decorators below."""

    localizers: dict[Target, LocalizeFn] = field(default_factory=dict)
    ranged: dict[Target, Ranged] = field(default_factory=dict)

    def shape_arg(self, index: int, *targets: Target) -> None:
        """Positional argument ``index`` of ``targets`` spells the first result's shape; on a rank it
        becomes the local shape."""
        for t in targets:
            self.localizers[t] = _shape_arg_localizer(index)

    def localizer(self, *targets: Target) -> Callable[[LocalizeFn], LocalizeFn]:
        """Register how to rewrite an op's non-tensor arguments for local shapes."""

        def deco(fn: LocalizeFn) -> LocalizeFn:
            for t in targets:
                self.localizers[t] = fn
            return fn

        return deco

    def ranged_impl(self, target: Target, where: Where) -> Callable[[Any], Any]:
        """Register the local form of ``target`` when its indexed dim (``where``) is sharded."""

        def deco(fn: Any) -> Any:
            self.ranged[target] = Ranged(where, fn)
            return fn

        return deco

    def local_args(
        self, op: Op, mesh: Mesh, layouts: Sequence[Layout] | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The args and kwargs a rank calls ``op`` with when its results are held in ``layouts``
        (default: the results' own) on ``mesh``; unchanged unless ``op`` has a localizer."""
        loc = self.localizers.get(op.target)
        if loc is None:
            return op.args, dict(op.kwargs)
        held = [r.layout for r in op.results] if layouts is None else layouts
        shapes = tuple(
            lay.local_shape(r.type.shape, mesh) if isinstance(r.type, TensorType) else ()
            for r, lay in zip(op.results, held, strict=True)
        )
        return loc(op, shapes)

    def slice_of(
        self, op: Op, mesh: Mesh, coord: Sequence[int], layouts: Sequence[Layout] | None = None
    ) -> tuple[int, int] | None:
        """``(lo, size)`` of the indexed dim's slice the rank at ``coord`` holds when ``op`` is ranged
        and that dim is sharded (``Layout.shard_bounds``), else None (run ``op`` as it is).
        ``layouts``: of the operands then the results (default: their own)."""
        ranged = self.ranged.get(op.target)
        if ranged is None:
            return None
        kind, i, dim = ranged.where(op)
        k = i if kind == "operand" else len(op.operands) + i
        v = (*op.operands, *op.results)[k]
        layout = v.layout if layouts is None else layouts[k]
        assert isinstance(v.type, TensorType), f"{op.describe()}: the indexed value is not a tensor"
        if not _shards(layout, dim):
            return None
        return layout.shard_bounds(v.type.shape, mesh, coord)[dim]


def _shards(layout: Layout, dim: int) -> bool:
    return any(isinstance(p, Shard) and p.dim == dim for p in layout.placements)


def _shape_arg_localizer(index: int) -> LocalizeFn:
    def localize(op: Op, local_shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Argument ``index`` becomes the first result's local shape; everything else is unchanged."""
        args = list(op.args)
        args[index] = tuple(local_shapes[0])
        return tuple(args), dict(op.kwargs)

    return localize


LOCAL = LocalForms()

# NOTE: shape-spelling arguments (the shape family and the factories).
LOCAL.shape_arg(
    1,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.view_copy.default,
    aten.expand.default,
    aten.expand_copy.default,
    aten.slice_backward.default,
    aten.select_backward.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_empty.default,
    aten.new_full.default,
)
LOCAL.shape_arg(0, aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format)


def _in_range(index: torch.Tensor, lo: int, size: int) -> torch.Tensor:
    return (index >= lo) & (index < lo + size)


# NOTE: embedding (see passes/sharding/rules/embedding.py: vocab-parallel strategies).
@LOCAL.ranged_impl(aten.embedding.default, lambda op: ("operand", 0, 0))
def embedding_ranged(lo: int, size: int, weight: torch.Tensor, indices: torch.Tensor, *rest: Any) -> torch.Tensor:
    """``embedding`` on rows ``[lo, lo + size)`` of the weight: other ids give zero rows."""
    mask = _in_range(indices, lo, size)
    rows: torch.Tensor = aten.embedding.default(weight, torch.where(mask, indices - lo, 0), *rest)
    return rows * mask.unsqueeze(-1).to(rows.dtype)


@LOCAL.ranged_impl(aten.embedding_dense_backward.default, lambda op: ("result", 0, 0))
def embedding_dense_backward_ranged(
    lo: int, size: int, grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int, scale: bool
) -> torch.Tensor:
    """The weight gradient's rows ``[lo, lo + size)``: gradients of other ids are dropped."""
    mask = _in_range(indices, lo, size)
    local_pad = padding_idx - lo if lo <= padding_idx < lo + size else -1
    masked = grad * mask.unsqueeze(-1).to(grad.dtype)
    out: torch.Tensor = aten.embedding_dense_backward.default(
        masked, torch.where(mask, indices - lo, 0), size, local_pad, scale
    )
    return out


@LOCAL.localizer(aten.embedding_dense_backward.default)
def localize_embedding_dense_backward(
    op: Op, local: tuple[tuple[int, ...], ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``num_weights`` is the result's dim 0; it is never sharded, but follow the local shape anyway."""
    args = list(op.args)
    if len(args) > 2 and local and local[0]:
        args[2] = local[0][0]
    result = op.results[0].type
    assert isinstance(result, TensorType) and result.rank == 2
    return tuple(args), dict(op.kwargs)


# NOTE: indexing (see passes/sharding/rules/indexing.py: ``self`` sharded along ``dim``).
def _along_self(op: Op) -> tuple[str, int, int]:
    src = op.operands[0].type
    assert isinstance(src, TensorType), f"{op.describe()}: self is not a tensor"
    return ("operand", 0, norm_dim(int_arg(op, "dim", 0), max(src.rank, 1)))


@LOCAL.ranged_impl(aten.gather.default, _along_self)
def gather_ranged(lo: int, size: int, x: torch.Tensor, dim: int, index: torch.Tensor, **kw: Any) -> torch.Tensor:
    """``gather`` on the slice ``[lo, lo + size)`` of ``dim``: other indices contribute zero."""
    mask = _in_range(index, lo, size)
    local: torch.Tensor = aten.gather.default(x, dim, torch.where(mask, index - lo, 0), **kw)
    return local * mask


def _scatter_ranged(
    target: Any, lo: int, size: int, x: torch.Tensor, dim: int, index: torch.Tensor, value: Any
) -> torch.Tensor:
    # NOTE: indices outside this rank's slice write into one padding slot that is cut off again.
    mask = _in_range(index, lo, size)
    pad = list(x.shape)
    pad[dim] = 1
    padded = torch.cat([x, x.new_zeros(pad)], dim)
    out: torch.Tensor = target(padded, dim, torch.where(mask, index - lo, size), value)
    return out.narrow(dim, 0, size).contiguous()


@LOCAL.ranged_impl(aten.scatter.value, _along_self)
def scatter_value_ranged(
    lo: int, size: int, x: torch.Tensor, dim: int, index: torch.Tensor, value: Any
) -> torch.Tensor:
    """``scatter.value`` on the slice ``[lo, lo + size)`` of ``dim``."""
    return _scatter_ranged(aten.scatter.value, lo, size, x, dim, index, value)


@LOCAL.ranged_impl(aten.scatter.src, _along_self)
def scatter_src_ranged(lo: int, size: int, x: torch.Tensor, dim: int, index: torch.Tensor, src: Any) -> torch.Tensor:
    """``scatter.src`` on the slice ``[lo, lo + size)`` of ``dim``."""
    return _scatter_ranged(aten.scatter.src, lo, size, x, dim, index, src)


# NOTE: routed experts (see passes/sharding/rules/routed_experts.py: the experts' dim 0 sharded).
@LOCAL.ranged_impl(EXPERTS, lambda op: ("operand", 3, 0))
def moe_experts_ranged(lo: int, size: int, *args: Any, **kw: Any) -> torch.Tensor:
    """This rank's experts ``[lo, lo + size)`` only (its slice of the weights)."""
    out: torch.Tensor = EXPERTS_RANGE(lo, *args, **kw)
    return out


@LOCAL.ranged_impl(EXPERTS_BACKWARD, lambda op: ("operand", 4, 0))
def moe_experts_backward_ranged(lo: int, size: int, *args: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
    """Gradients of this rank's experts ``[lo, lo + size)`` only."""
    grads: tuple[torch.Tensor, ...] = EXPERTS_RANGE_BACKWARD(lo, *args, **kw)
    return grads
