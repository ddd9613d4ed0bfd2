"""The one adapter to DTensor's sharding registries, for ops that have no rule of ours.

DTensor keeps two tables on its sharding propagator: ``op_single_dim_strategy_funcs`` (a function
of ``(op, args_meta, kwargs_meta)`` returning single-mesh-dim placement lists, outputs first,
with ``_ShardingPlaceholder(dim)`` for "shard this dim") and ``op_strategy_funcs`` (a function of
an ``OpSchema`` of ``OpStrategy`` inputs on a mesh returning an ``OpStrategy`` of ``OpSpec``s).
The first needs no mesh; the second gets a one-dimensional ``DeviceMesh`` built without a
process group (``_init_backend=False``), so nothing global in ``torch.distributed`` changes. Both
answers become our single-axis :class:`Strategy` list; placements we cannot express
(``_StridedShard``, ``Partial`` with other reduce ops or subclasses such as ``_MaskPartial``) drop
the strategy.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch._ops import OpOverload

from meshfold.ir import Arg, Op, Partial, Placement, R, Shard, TensorType, Value
from meshfold.ir.placement import REDUCE_OPS
from meshfold.passes.sharding.strategy import Strategy

MESH_SIZE = 2


def _dtensor_propagator() -> Any | None:
    """DTensor's sharding propagator, or None where ``torch.distributed`` is unavailable."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor._op_dispatcher.sharding_propagator


def dtensor_ops() -> set[OpOverload]:
    """Every op either DTensor registry knows (empty where DTensor is unavailable)."""
    prop = _dtensor_propagator()
    if prop is None:
        return set()
    return set(getattr(prop, "op_single_dim_strategy_funcs", {})) | set(prop.op_strategy_funcs)


def fallback_strategies(op: Op) -> list[Strategy] | None:
    """DTensor's single-axis strategies for ``op`` in our terms; None when DTensor has nothing.

    Needs static shapes; an op DTensor cannot answer for these arguments (its function raises)
    also gives None. Strategies that shard an op whose arguments DTensor rewrites for local shapes
    (``view`` sizes, ``group_norm``'s ``N``) are dropped: ``backends/local.py`` cannot rewrite those.
    """
    prop = _dtensor_propagator()
    target = op.target
    if prop is None or not isinstance(target, OpOverload):
        return None
    # NOTE: torch < 2.12 has no single-dim table; every lookup tolerates a missing attribute.
    single = getattr(prop, "op_single_dim_strategy_funcs", {}).get(target)
    full = prop.op_strategy_funcs.get(target)
    if single is None and full is None:
        return None
    tensors = [i for i, v in enumerate(op.operands) if isinstance(v.type, TensorType)]
    if not all(_static(op.operands[i]) for i in tensors):
        return None
    try:
        raw = _single_dim(single, op) if single is not None else _from_op_strategy(full, op, prop, len(tensors))
    except Exception:
        # NOTE: a DTensor strategy function that rejects these arguments means "no answer", not a bug of ours.
        return None
    rewrites = any(
        target in getattr(prop, table, {})
        for table in ("op_to_shape_and_stride_idx", "op_to_scalar_shape_adjuster", "squeeze_op_to_dims_variant")
    )
    out: list[Strategy] = []
    for outs, ins in raw:
        s = _convert(op, tensors, outs, ins)
        if s is None or (rewrites and any(isinstance(p, Shard) for p in (*s.inputs, *s.outputs))):
            continue
        out.append(s)
    return list(dict.fromkeys(out))


def _static(v: Value) -> bool:
    return isinstance(v.type, TensorType) and v.type.is_static()


def _meta(v: Value) -> Any:
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    t = v.type
    assert isinstance(t, TensorType)
    shape = torch.Size(int(d) for d in t.shape)
    return TensorMeta(shape, _contiguous_stride(shape), t.dtype)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride: list[int] = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def _map_args(arg: Arg, leaf: Any) -> Any:
    """Our (frozen) argument with each tensor value replaced by ``leaf(value)`` and tuples as lists,
    the way DTensor's functions see a dispatched call."""
    if isinstance(arg, Value):
        if not isinstance(arg.type, TensorType):
            raise ValueError("a symbolic scalar argument")
        return leaf(arg)
    if isinstance(arg, tuple):
        return [_map_args(a, leaf) for a in arg]
    if hasattr(arg, "free_symbols"):
        raise ValueError("a symbolic argument")
    return arg


def _single_dim(info: Any, op: Op) -> list[tuple[list[Any], list[Any]]]:
    """Call a single-dim strategy function; split each answer into (outputs, inputs)."""
    args = tuple(_map_args(a, _meta) for a in op.args)
    kwargs = {k: _map_args(v, _meta) for k, v in op.kwargs}
    target = op.target
    assert isinstance(target, OpOverload)
    n_out = sum(1 for r in target._schema.returns if "Tensor" in str(r.type))
    answers = getattr(info, "func", info)(target, args, kwargs)
    return [(list(a[:n_out]), list(a[n_out:])) for a in answers]


def _from_op_strategy(func: Any, op: Op, prop: Any, n_tensors: int) -> list[tuple[list[Any], list[Any]]]:
    """Call an ``OpSchema`` strategy function on a 1-D fake mesh, once per seed input placement
    (strategies that follow their input only answer for the placement they are given)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
    from torch.distributed.tensor.placement_types import Partial as DPartial
    from torch.distributed.tensor.placement_types import Replicate as DReplicate
    from torch.distributed.tensor.placement_types import Shard as DShard

    mesh = DeviceMesh("cpu", torch.arange(MESH_SIZE), _init_backend=False, _rank=0)
    target = op.target
    assert isinstance(target, OpOverload)
    tensor_values = [v for v in op.operands if isinstance(v.type, TensorType)]
    ranks = [v.type.rank for v in tensor_values if isinstance(v.type, TensorType)]

    def seeds() -> Iterator[tuple[Any, ...]]:
        yield tuple(DReplicate() for _ in ranks)
        for i, r in enumerate(ranks):
            for d in range(r):
                yield tuple(DShard(d) if j == i else DReplicate() for j in range(len(ranks)))
            yield tuple(DPartial() if j == i else DReplicate() for j in range(len(ranks)))
        for d in range(min(ranks, default=0)):
            yield tuple(DShard(d) for _ in ranks)
        yield tuple(DPartial() for _ in ranks)

    found: list[tuple[list[Any], list[Any]]] = []
    for seed in seeds():
        it = iter(seed)

        def strategy(v: Value, it: Iterator[Any] = it) -> Any:
            return OpStrategy([OpSpec(DTensorSpec(mesh, (next(it),), tensor_meta=_meta(v)))])

        def wrap(a: Arg) -> Any:
            if isinstance(a, tuple) and a and all(isinstance(x, Value) for x in a):
                return TupleStrategy(tuple(strategy(x) for x in a if isinstance(x, Value)))
            return _map_args(a, strategy)

        schema = OpSchema(
            target,
            tuple(wrap(a) for a in op.args),
            {k: wrap(v) for k, v in op.kwargs},
            schema_info=getattr(prop, "op_to_schema_info", {}).get(target),
        )
        answer = func(schema)
        if not isinstance(answer, OpStrategy):
            return []
        for spec in answer.strategies:
            outs = spec.output_specs
            out_list = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            out_pl = [None if s is None else s.placements[0] for s in out_list]
            if spec.input_specs is None:
                in_pl = [out_pl[0] for _ in range(n_tensors)]
            else:
                in_pl = [s.placements[0] for s in spec.input_specs]
            found.append((out_pl, in_pl))
    return found


def _placement(p: Any) -> Placement | None:
    """DTensor placement (or placeholder) → ours; None when ours cannot express it."""
    from torch.distributed.tensor.placement_types import Partial as DPartial
    from torch.distributed.tensor.placement_types import Replicate as DReplicate
    from torch.distributed.tensor.placement_types import Shard as DShard

    if p is None or type(p) is DReplicate:
        return R
    # NOTE: single-dim answers spell "shard this dim" as a _ShardingPlaceholder (torch >= 2.12).
    if type(p) is DShard or type(p).__name__ == "_ShardingPlaceholder":
        return Shard(int(p.dim))
    if type(p) is DPartial:
        for kind in REDUCE_OPS:
            if p.reduce_op == kind:
                return Partial(kind)
    return None


def _convert(op: Op, tensors: list[int], outs: list[Any], ins: list[Any]) -> Strategy | None:
    """One DTensor answer → a :class:`Strategy` over all operands and results, or None."""
    if len(ins) != len(tensors):
        return None
    inputs: list[Placement] = [R for _ in op.operands]
    for pos, p in zip(tensors, ins, strict=True):
        q = _placement(p)
        if q is None:
            return None
        inputs[pos] = q
    outputs: list[Placement] = []
    for k in _result_slots(op, len(outs)):
        q = R if k is None else _placement(outs[k])
        if q is None:
            return None
        outputs.append(q)
    return Strategy(tuple(inputs), tuple(outputs))


def _result_slots(op: Op, n_answers: int) -> list[int | None]:
    """For each of our results, the index of DTensor's output placement describing it (None: a
    non-tensor result, Replicate)."""
    target = op.target
    assert isinstance(target, OpOverload)
    returns = target._schema.returns
    if len(returns) == 1 and str(returns[0].type).startswith("List"):
        return [min(i, n_answers - 1) for i in range(len(op.results))]
    slots: list[int | None] = []
    k = 0
    for r, res in itertools.zip_longest(returns, op.results):
        if res is None:
            break
        if r is not None and "Tensor" in str(r.type):
            slots.append(k if isinstance(res.type, TensorType) and k < n_answers else None)
            k += 1
        else:
            slots.append(None)
    return slots
