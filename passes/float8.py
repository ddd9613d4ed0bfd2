"""Float8 all-gathers: a value gathered only to be cast to float8 is cast on its shard and gathered
as float8.

torchao's tensorwise float8 recipe casts a weight ``w`` with a scale taken from its amax::

    s = 448 / max(abs(w));  w8 = (w * s).clamp(-448, 448).to(float8_e4m3fn)

Under fsdp the sharding pass gathers ``w`` at its first use, so every rank receives ``w`` in its
compute dtype (4 or 2 bytes an element) and casts all of it. Nothing in that chain needs the whole
tensor but the amax, and a max is exact under any split: each rank takes the amax of its own shard,
an all-reduce(max) over the gathering axis makes it the whole tensor's, and the product, clamp and
cast are elementwise, so each rank casts its shard to the very bytes one device would cast there.
The ``float8-gather`` pass rewrites every all-gather whose result is read only that way (through
views, by ``abs -> max`` and by ``mul(·, scalar) -> clamp -> to(float8)`` chains): the amaxes on the
shard with one all-reduce each, the casts on the shard, one all-gather of float8 bytes per cast,
and the views applied to what it gathers. It does so only where that moves fewer bytes (fewer casts
than the gathered dtype has bytes), as torchao's ``enable_fsdp_float8_all_gather`` does for weights.
The rowwise recipe takes an amax per row (``amax(dim)``) and is left as it is, as in torchao.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from meshfold.ir import Graph, GraphBuilder, Op, Partial, TensorType, Value, is_float8, is_view
from meshfold.ir.graph import remap_op
from meshfold.ir.ops import ALL_GATHER, ALL_REDUCE
from meshfold.passes.base import Pass
from meshfold.passes.sharding.boxing import BOXED

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

aten = torch.ops.aten
_CAST = aten._to_copy.default


@dataclass
class _Site:
    """One all-gather the pass rewrites: its views (view op -> the value it views), and the ops of
    its amaxes (``abs``, ``max``) and casts (``mul``, ``clamp``, ``_to_copy``)."""

    gather: Op
    base: dict[Value, Value] = field(default_factory=dict)  # NOTE: view result -> what it views
    views: dict[Value, Op] = field(default_factory=dict)
    amax: dict[Op, str] = field(default_factory=dict)  # NOTE: op -> "abs" | "max"
    cast: dict[Op, str] = field(default_factory=dict)  # NOTE: op -> "mul" | "clamp" | "to"
    viewed: dict[Op, Value] = field(default_factory=dict)  # NOTE: a cast's "to" -> the view it casts

    @property
    def shard(self) -> Value:
        return self.gather.operands[0]


def _only_user(users: dict[Value, list[Op]], outputs: set[Value], v: Value) -> Op | None:
    got = users.get(v, [])
    return got[0] if len(got) == 1 and v not in outputs else None


def _site(gather: Op, users: dict[Value, list[Op]], outputs: set[Value]) -> _Site | None:
    """``gather`` as a site of the pass, or None where some reader of what it gathers needs the
    gathered values themselves (module docstring)."""
    site = _Site(gather)
    frontier = [gather.result]
    reached = {gather.result}
    while frontier:
        v = frontier.pop()
        if v in outputs:
            return None
        for u in users.get(v, []):
            if is_view(u.target) and len(u.results) == 1 and u.operands == (v,):
                site.base[u.result], site.views[u.result] = v, u
                reached.add(u.result)
                frontier.append(u.result)
            elif u.target == aten.abs.default:
                top = _only_user(users, outputs, u.result)
                if top is None or top.target != aten.max.default:
                    return None
                site.amax.update({u: "abs", top: "max"})
            elif u.target == aten.mul.Tensor and _scaled(u, v, reached):
                clamp = _only_user(users, outputs, u.result)
                to = _only_user(users, outputs, clamp.result) if clamp is not None else None
                if clamp is None or clamp.target != aten.clamp.default or to is None or to.target != _CAST:
                    return None
                if set(dict(to.kwargs)) != {"dtype"} or not is_float8(to.kwarg("dtype")):  # type: ignore[arg-type]
                    return None
                site.cast.update({u: "mul", clamp: "clamp", to: "to"})
                site.viewed[to] = v
            else:
                return None
    t = gather.result.type
    casts = sum(kind == "to" for kind in site.cast.values())
    if not isinstance(t, TensorType) or not casts or casts >= t.dtype.itemsize:
        return None
    return site


def _scaled(mul: Op, v: Value, reached: set[Value]) -> bool:
    """Whether ``mul`` is ``v`` times a scalar tensor the gathered values do not reach."""
    if len(mul.args) != 2 or mul.args[0] is not v:
        return False
    s = mul.args[1]
    return isinstance(s, Value) and s not in reached and isinstance(s.type, TensorType) and s.type.rank == 0


def _like(v: Value, shape_of: Value, dtype: torch.dtype | None = None, layout: object = None) -> Value:
    """A new value named like ``v``, with ``shape_of``'s shape (and layout, unless given), in
    ``dtype`` (else ``v``'s)."""
    t, s = v.type, shape_of.type
    assert isinstance(t, TensorType) and isinstance(s, TensorType)
    return Value(v.name, TensorType(s.shape, dtype or t.dtype), layout if layout is not None else shape_of.layout)  # type: ignore[arg-type]


class Float8Gathers(Pass):
    """Cast on the shard, gather float8 (module docstring). A graph with no such all-gather is left
    as it is."""

    name: ClassVar[str] = "float8-gather"
    requires: ClassVar[frozenset[str]] = frozenset({BOXED})
    invalidates: ClassVar[frozenset[str]] = frozenset({"scheduled", "bucketed"})

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        users = graph.users()
        outputs = {o.value for o in graph.outputs}
        sites = [s for op in graph.ops if op.target == ALL_GATHER and (s := _site(op, users, outputs))]
        if not sites:
            return graph
        of: dict[Op, _Site] = {}
        for s in sites:
            of.update(dict.fromkeys([s.gather, *s.views.values(), *s.amax, *s.cast], s))
        b = GraphBuilder.like(graph)
        new: dict[Value, Value] = {}
        for op in graph.ops:
            site = of.get(op)
            if site is None:
                b.append(remap_op(op, new))
            elif op in site.amax:
                self._amax(b, op, site, new)
            elif op in site.cast:
                self._cast(b, op, site, new)
            # NOTE: the gather and its views are made again after each cast, on float8 bytes
        for o in graph.outputs:
            b.add_output(o.kind, o.name, new.get(o.value, o.value))
        ctx.stats["float8.gathers"] = len(sites)
        return b.build()

    @staticmethod
    def _amax(b: GraphBuilder, op: Op, site: _Site, new: dict[Value, Value]) -> None:
        axis = site.gather.kwarg("axis")
        if site.amax[op] == "abs":
            (new[op.result],) = b.add_op(op.target, (site.shard,), op.kwargs, (_like(op.result, site.shard),), op.prov)
            return
        r = op.result
        part = Value(r.name, r.type, r.layout.with_placement(str(axis), Partial("max")))
        b.add_op(op.target, (new[op.operands[0]],), op.kwargs, (part,), op.prov)
        (new[r],) = b.add_op(
            ALL_REDUCE, (part,), (("axis", axis), ("reduce", "max")), (Value(r.name, r.type, r.layout),), op.prov
        )

    @staticmethod
    def _cast(b: GraphBuilder, op: Op, site: _Site, new: dict[Value, Value]) -> None:
        kind = site.cast[op]
        first = site.shard if kind == "mul" else new[op.operands[0]]
        args = (first, *(new.get(a, a) if isinstance(a, Value) else a for a in op.args[1:]))
        dtype = op.kwarg("dtype") if kind == "to" else None
        (local,) = b.add_op(op.target, args, op.kwargs, (_like(op.result, site.shard, dtype),), op.prov)  # type: ignore[arg-type]
        if kind != "to":
            new[op.result] = local
            return
        g, f8 = site.gather, dtype
        assert isinstance(f8, torch.dtype)
        (v,) = b.add_op(g.target, (local,), g.kwargs, (_like(g.result, g.result, f8),), g.prov)
        chain = []
        x = site.viewed[op]
        while x in site.views:
            chain.append(site.views[x])
            x = site.base[x]
        for view in reversed(chain):
            (v,) = b.add_op(
                view.target,
                (v, *view.args[1:]),
                view.kwargs,
                (_like(view.result, view.result, f8),),
                view.prov,
            )
        new[op.result] = v
