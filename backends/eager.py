"""Lower a boxed SPMD graph to one rank's forward and backward ``fx.GraphModule``s.

Types in the IR are global; here each value gets its local shape from its layout
(``Layout.local_shape``), shape-spelling arguments are rewritten and ranged ops run on their slice
as ``backends/local.py`` says, and ``comm.*`` ops become
``torch.ops._c10d_functional`` collectives (+ ``wait_tensor``) on the mesh's process groups.
The joint graph is split by phase: forward ops form the forward module, which also returns the
values the backward needs ("saved"); backward ops form the backward module.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from meshfold import ir
from meshfold.backends.interpret import runnable_target
from meshfold.backends.local import LOCAL, LocalForms
from meshfold.backends.moe import exchange_backward, exchange_forward
from meshfold.backends.random import is_random, random_site
from meshfold.backends.watch import Watch, watch_waits
from meshfold.ir import Graph, Op, OpDef, Shard, TensorType, Value
from meshfold.ir.graph import Arg
from meshfold.ir.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.ir.ops import (
    ALL_GATHER,
    ALL_GATHER_BUCKET,
    ALL_REDUCE,
    ALL_TO_ALL,
    PARTIAL,
    REDISTRIBUTE,
    REDUCE_SCATTER,
    REDUCE_SCATTER_BUCKET,
    SHARD,
)

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


@dataclass(frozen=True)
class RankContext:
    """What lowering needs to know about this rank: mesh sizes, its coordinate, group names."""

    mesh: ir.Mesh
    coordinate: tuple[int, ...]
    group_names: tuple[str, ...]
    flat_groups: tuple[tuple[tuple[str, ...], str], ...] = ()
    """Groups over several mesh axes at once (``exchange_axes`` says which a graph needs)."""

    def size(self, axis: str) -> int:
        return self.mesh.size(axis)

    def coord(self, axis: str) -> int:
        return self.coordinate[self.mesh.index(axis)]

    def group(self, axis: str) -> str:
        return self.group_names[self.mesh.index(axis)]

    def group_over(self, axes: tuple[str, ...]) -> str:
        """The process group spanning ``axes`` (in mesh order), ranks numbered row-major."""
        if len(axes) == 1:
            return self.group(axes[0])
        for key, name in self.flat_groups:
            if key == axes:
                return name
        raise ValueError(f"no process group over mesh axes {axes}; create it before lowering (exchange_axes)")


@dataclass(frozen=True)
class Lowered:
    """One rank's program: forward and backward modules and how to call them."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    fwd_inputs: tuple[str, ...]
    """Graph input names, in the forward module's placeholder order."""
    fwd_outputs: tuple[tuple[str, str], ...]
    """(kind, name) of the forward module's leading results; the saved values follow them."""
    n_saved: int
    bwd_inputs: tuple[str, ...]
    """Tangent names the backward module takes after the saved values."""
    bwd_outputs: tuple[str, ...]
    """Parameter names whose gradients the backward module returns, in order."""
    fwd_recorded: tuple[Value, ...] = ()
    """With ``record``: values the forward module returns after the saved ones."""
    bwd_recorded: tuple[Value, ...] = ()
    """With ``record``: values the backward module returns after the gradients."""


def lower(graph: Graph, rank: RankContext, *, record: bool = False, rng: torch.Generator | None = None) -> Lowered:
    """Split ``graph`` by phase and lower both halves for ``rank``.

    ``record``: each module also returns, after its usual results, the local value of every tensor
    its ops produce (``Lowered.fwd_recorded`` / ``bwd_recorded`` say which), for verification.
    ``rng``: the generator the program's random ops draw from (``backends/random.py``; default: this
    process's default generator, which gives every rank the same values only when all are seeded alike).
    """
    if any(op.target == REDISTRIBUTE for op in graph.ops):
        raise ValueError("graph still has comm.redistribute ops; run the boxing pass before lowering")
    fwd_ops = [op for op in graph.ops if op.prov.phase == "fwd"]
    bwd_ops = [op for op in graph.ops if op.prov.phase == "bwd"]
    fwd_defined = {i.value for i in graph.inputs if i.kind != "tangent"} | {r for op in fwd_ops for r in op.results}
    for op in fwd_ops:
        for v in op.operands:
            if v not in fwd_defined:
                raise ValueError(f"{op.describe()}: forward op uses %{v.name}, which only the backward defines")
    fwd_out = [o for o in graph.outputs if o.kind in ("out", "update")]
    grads = [o for o in graph.outputs if o.kind == "grad"]
    tangents = [i for i in graph.inputs if i.kind == "tangent"]
    tangent_vals = {i.value for i in tangents}
    bwd_defined = {r for op in bwd_ops for r in op.results} | tangent_vals
    saved: list[Value] = []
    for v in [*(u for op in bwd_ops for u in op.operands), *(o.value for o in grads)]:
        if v not in bwd_defined and v not in saved:
            saved.append(v)
    fwd_inputs = [i for i in graph.inputs if i.kind != "tangent"]
    fwd_rec = _recorded(fwd_ops) if record else []
    bwd_rec = _recorded(bwd_ops) if record else []
    gen = rng if rng is not None else torch.default_generator
    forward = _build([i.value for i in fwd_inputs], fwd_ops, [o.value for o in fwd_out] + saved + fwd_rec, rank, gen)
    backward = _build(saved + [i.value for i in tangents], bwd_ops, [o.value for o in grads] + bwd_rec, rank, gen)
    return Lowered(
        forward,
        backward,
        tuple(i.name for i in fwd_inputs),
        tuple((o.kind, o.name) for o in fwd_out),
        len(saved),
        tuple(i.name for i in tangents),
        tuple(o.name for o in grads),
        tuple(fwd_rec),
        tuple(bwd_rec),
    )


def _recorded(ops: Sequence[Op]) -> list[Value]:
    return [r for op in ops for r in op.results if isinstance(r.type, TensorType)]


def _build(
    inputs: Sequence[Value],
    ops: Sequence[Op],
    outputs: Sequence[Value],
    rank: RankContext,
    rng: torch.Generator,
) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[Value, fx.Node] = {}
    for k, v in enumerate(inputs):
        env[v] = g.placeholder(f"in{k}")
    for op in ops:
        last = g._root.prev  # NOTE: the node before this op's; its collectives' waits are named after it
        outs = _emit(g, op, env, rank, LOCAL, rng)
        if isinstance(op.target, OpDef) or op.target in _EXCHANGES:
            _watched(g, last, op, rank)
        for r, node in zip(op.results, outs, strict=True):
            env[r] = node
    g.output(tuple(env[v] for v in outputs))
    g.lint()
    return fx.GraphModule(torch.nn.Module(), g)


def _watched(g: fx.Graph, last: fx.Node, op: Op, rank: RankContext) -> None:
    """Name ``op`` (and its mesh axes) in the error its collectives raise when a peer is stuck or gone."""
    axes = [str(op.kwarg("axis"))] if isinstance(op.target, OpDef) else list(_exchange_over(op))
    over = " and ".join(f"{a!r} ({rank.size(a)} ranks)" for a in axes if a in rank.mesh.names) or "(none)"
    what = f"{op.describe()} over mesh axis {over}, waited on by rank {rank.coordinate} of {rank.mesh}"
    watch_waits(g, last, what)
    for node in _after(last):
        if node.op == "call_function" and getattr(node.target, "__module__", "") == exchange_forward.__module__:
            node.target = Watch(node.target, f"the token exchange of {what}")


def _after(last: fx.Node) -> list[fx.Node]:
    out, node = [], last.next
    while node.op != "root":
        out.append(node)
        node = node.next
    return out


def _load(a: Arg, env: dict[Value, fx.Node]) -> Any:
    if isinstance(a, Value):
        return env[a]
    if isinstance(a, tuple):
        return [_load(x, env) for x in a]
    return a


def _emit(
    g: fx.Graph, op: Op, env: dict[Value, fx.Node], rank: RankContext, table: LocalForms, rng: torch.Generator
) -> list[fx.Node]:
    if op.target in (ALL_GATHER_BUCKET, REDUCE_SCATTER_BUCKET):
        return _bucket(g, op, [env[x] for x in op.operands], rank)
    if isinstance(op.target, OpDef):
        (x,) = op.operands
        return [_collective(g, op, env[x], x, rank)]
    if is_random(op):
        site = random_site(op, rng, rank.mesh, rank.coordinate)
        node = g.call_function(site, tuple(_load(a, env) for a in op.args), {k: _load(v, env) for k, v in op.kwargs})
        return _unpacked(g, op, node)
    args, kwargs = table.local_args(op, rank.mesh)
    exchange = _exchange_call(op, rank)
    if exchange is not None:
        fn, peers = exchange
        node = g.call_function(
            fn, (*peers, *(_load(a, env) for a in args)), {k: _load(v, env) for k, v in kwargs.items()}
        )
        return _unpacked(g, op, node)
    bounds = table.slice_of(op, rank.mesh, rank.coordinate)
    if bounds is not None:
        impl = table.ranged[op.target].impl
        loaded = tuple(_load(a, env) for a in args)
        node = g.call_function(impl, (*bounds, *loaded), {k: _load(v, env) for k, v in kwargs.items()})
        return _unpacked(g, op, node)
    node = g.call_function(
        runnable_target(op.target), tuple(_load(a, env) for a in args), {k: _load(v, env) for k, v in kwargs.items()}
    )
    return _unpacked(g, op, node)


def _unpacked(g: fx.Graph, op: Op, node: fx.Node) -> list[fx.Node]:
    """One node per result of ``op`` (``getitem``s when the call returns several)."""
    if len(op.results) == 1 and not _returns_sequence(op):
        return [node]
    return [g.call_function(operator.getitem, (node, i)) for i in range(len(op.results))]


def _returns_sequence(op: Op) -> bool:
    target = op.target
    assert not isinstance(target, OpDef)
    rets = target._schema.returns
    return len(rets) != 1 or str(rets[0].type).startswith("List")


def _collective(g: fx.Graph, op: Op, x: fx.Node, xv: Value, rank: RankContext) -> fx.Node:
    axis = str(op.kwarg("axis"))
    n = rank.size(axis)
    group = rank.group(axis)
    if n == 1:
        return x  # NOTE: every layout change on a one-rank axis is the identity
    if op.target == ALL_GATHER:
        return _gather(g, x, int(op.kwarg("dim")), n, group)  # type: ignore[arg-type]
    if op.target == ALL_REDUCE:
        reduce = str(op.kwarg("reduce"))
        red = "sum" if reduce == "avg" else reduce
        waited = _wait(g, g.call_function(c10d.all_reduce.default, (x, red, group)))
        return g.call_function(aten.div.Tensor, (waited, n)) if reduce == "avg" else waited
    if op.target == REDUCE_SCATTER:
        dim = int(op.kwarg("dim"))  # type: ignore[arg-type]
        reduce = str(op.kwarg("reduce"))
        if reduce == "max":
            full = _wait(g, g.call_function(c10d.all_reduce.default, (x, "max", group)))
            return _chunk(g, full, dim, n, rank.coord(axis))
        out = _wait(g, g.call_function(c10d.reduce_scatter_tensor.default, (_to_front(g, x, dim), "sum", n, group)))
        back = _from_front(g, out, dim)
        return g.call_function(aten.div.Tensor, (back, n)) if reduce == "avg" else back
    if op.target == ALL_TO_ALL:
        # NOTE: realized as gather + local chunk (same result; an all_to_all_single moves less).
        full = _gather(g, x, int(op.kwarg("concat_dim")), n, group)  # type: ignore[arg-type]
        return _chunk(g, full, int(op.kwarg("split_dim")), n, rank.coord(axis))  # type: ignore[arg-type]
    if op.target == SHARD:
        return _chunk(g, x, int(op.kwarg("dim")), n, rank.coord(axis))  # type: ignore[arg-type]
    if op.target == PARTIAL:
        reduce = str(op.kwarg("reduce"))
        if reduce == "sum" and rank.coord(axis) != 0:
            return g.call_function(aten.zeros_like.default, (x,))
        return x
    raise ValueError(f"{op.describe()}: no eager lowering for {op.name}")


def _bucket(g: fx.Graph, op: Op, xs: list[fx.Node], rank: RankContext) -> list[fx.Node]:
    """A bucketed all-gather or reduce-scatter: every operand, moved so its dim leads, is flattened
    into one buffer (reduce-scatter: as ``[n, chunk]`` rows, so rank r's rows land on rank r), one
    collective runs on it, and each result is cut back out and reshaped."""
    axis = str(op.kwarg("axis"))
    n = rank.size(axis)
    if n == 1:
        return list(xs)
    group = rank.group(axis)
    dims = [int(d) for d in op.kwarg("dims")]  # type: ignore[union-attr]
    fronts = [_to_front(g, x, d) for x, d in zip(xs, dims, strict=True)]
    shapes = []
    for v, d in zip(op.operands, dims, strict=True):
        assert isinstance(v.type, TensorType)
        shape = list(v.layout.local_shape(v.type.shape, rank.mesh))
        shapes.append([shape[d], *shape[:d], *shape[d + 1 :]])  # the local shape with dim d in front
    outs: list[fx.Node] = []
    if op.target == ALL_GATHER_BUCKET:
        flat = g.call_function(aten.cat.default, ([g.call_function(aten.reshape.default, (f, [-1])) for f in fronts],))
        full = _wait(g, g.call_function(c10d.all_gather_into_tensor.default, (flat, n, group)))
        rows = g.call_function(aten.reshape.default, (full, [n, -1]))
        off = 0
        for shape, d in zip(shapes, dims, strict=True):
            size = math.prod(shape)
            piece = g.call_function(aten.slice.Tensor, (rows, 1, off, off + size))
            whole = g.call_function(aten.reshape.default, (piece, [n * shape[0], *shape[1:]]))
            outs.append(_from_front(g, whole, d) if d else _contiguous(g, whole))
            off += size
        return outs
    reduce = str(op.kwarg("reduce"))
    rows_in = [g.call_function(aten.reshape.default, (f, [n, -1])) for f in fronts]
    flat = g.call_function(aten.reshape.default, (g.call_function(aten.cat.default, (rows_in, 1)), [-1]))
    mine = _wait(g, g.call_function(c10d.reduce_scatter_tensor.default, (flat, "sum", n, group)))
    if reduce == "avg":
        mine = g.call_function(aten.div.Tensor, (mine, n))
    off = 0
    for shape, d in zip(shapes, dims, strict=True):
        size = math.prod(shape) // n
        piece = g.call_function(aten.slice.Tensor, (mine, 0, off, off + size))
        part = g.call_function(aten.reshape.default, (piece, [shape[0] // n, *shape[1:]]))
        outs.append(_from_front(g, part, d) if d else _contiguous(g, part))
        off += size
    return outs


def _contiguous(g: fx.Graph, x: fx.Node) -> fx.Node:
    return g.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})


def _to_front(g: fx.Graph, x: fx.Node, dim: int) -> fx.Node:
    """``x`` with ``dim`` moved to the front, contiguous (collectives work on dim 0)."""
    return _contiguous(g, g.call_function(aten.movedim.int, (x, dim, 0)) if dim else x)


def _from_front(g: fx.Graph, x: fx.Node, dim: int) -> fx.Node:
    return _contiguous(g, g.call_function(aten.movedim.int, (x, 0, dim))) if dim else x


def _wait(g: fx.Graph, x: fx.Node) -> fx.Node:
    return g.call_function(c10d.wait_tensor.default, (x,))


def _gather(g: fx.Graph, x: fx.Node, dim: int, n: int, group: str) -> fx.Node:
    out = _wait(g, g.call_function(c10d.all_gather_into_tensor.default, (_to_front(g, x, dim), n, group)))
    return _from_front(g, out, dim)


def _chunk(g: fx.Graph, x: fx.Node, dim: int, n: int, coord: int) -> fx.Node:
    """This rank's contiguous chunk of ``x`` along ``dim`` (a local slice, no communication)."""
    parts = g.call_function(aten.chunk.default, (x, n, dim))
    piece = g.call_function(operator.getitem, (parts, coord))
    return g.call_function(aten.clone.default, (piece,), {"memory_format": torch.contiguous_format})


# NOTE: (tokens operand, expert-weight operand) of the ops that exchange tokens themselves.
_EXCHANGES = {EXPERTS: (0, 3, exchange_forward), EXPERTS_BACKWARD: (1, 4, exchange_backward)}


def _exchange_over(op: Op) -> tuple[str, ...]:
    """Mesh axes over which ``op`` (a routed-experts op) splits tokens and experts alike."""
    if op.target not in _EXCHANGES:
        return ()
    tokens, weights, _ = _EXCHANGES[op.target]
    t, w = op.operands[tokens].layout, op.operands[weights].layout
    s0 = Shard(0)
    return tuple(a for a in t.axes if t.placement(a) == s0 and w.placement(a) == s0)


def exchange_axes(graph: Graph) -> list[tuple[str, ...]]:
    """The multi-axis groups lowering ``graph`` needs (see ``RankContext.flat_groups``)."""
    out: list[tuple[str, ...]] = []
    for op in graph.ops:
        axes = _exchange_over(op)
        if len(axes) > 1 and axes not in out and op.args[-1] != "hierarchical":
            out.append(axes)
    return out


def _exchange_call(op: Op, rank: RankContext) -> tuple[Any, tuple[Any, ...]] | None:
    """The all-to-all dispatcher's function and its peer description, when ``op`` needs one."""
    axes = tuple(a for a in rank.mesh.names if a in _exchange_over(op))
    if not axes:
        return None
    _, weights, fn = _EXCHANGES[op.target]
    w = op.operands[weights]
    assert isinstance(w.type, TensorType)
    coords = [rank.coordinate]
    for a in axes:  # NOTE: peers in row-major order over the exchange axes
        i = rank.mesh.index(a)
        coords = [(*c[:i], j, *c[i + 1 :]) for c in coords for j in range(rank.size(a))]
    # NOTE: the first expert each peer holds: its offset on the expert weight's dim 0
    los = tuple(w.layout.shard_bounds(w.type.shape, rank.mesh, c)[0][0] for c in coords)
    size = w.layout.local_shape(w.type.shape, rank.mesh)[0]
    if op.args[-1] == "hierarchical" and len(axes) > 1:
        # NOTE: one hop per axis, innermost first; an axis's digit in the row-major slot has this stride
        strides = [math.prod(rank.size(b) for b in axes[i + 1 :]) for i in range(len(axes))]
        hops = tuple((rank.group(a), rank.size(a), st) for a, st in reversed(list(zip(axes, strides, strict=True))))
    else:
        hops = ((rank.group_over(axes), len(coords), 1),)
    return fn, (hops, coords.index(rank.coordinate), los, size)
