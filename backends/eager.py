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
from meshfold.backends.collectives import Issued, issue, local_shapes
from meshfold.backends.context_parallel.halo import causal_conv1d_backward_split, causal_conv1d_split
from meshfold.backends.context_parallel.ring_lowering import KERNELS as RING_KERNELS
from meshfold.backends.context_parallel.ring_lowering import kernel_backward as ring_kernel_backward
from meshfold.backends.context_parallel.split_scans import (
    affine_scan_backward_split,
    affine_scan_split,
    cumsum_split,
    flip_split,
)
from meshfold.backends.experts.dispatch import exchange_backward, exchange_forward
from meshfold.backends.host_tier import offload, reload, reload_start, reload_wait
from meshfold.backends.interpret import runnable_target
from meshfold.backends.local import LOCAL, LocalForms
from meshfold.backends.phases import phases, recorded_values
from meshfold.backends.random import is_random, random_site
from meshfold.backends.watch import Watch, watch_waits
from meshfold.ir import Graph, Op, OpDef, TensorType, Value
from meshfold.ir.dialects.conv import CONV, CONV_BACKWARD
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD, TOKENS_AND_WEIGHTS
from meshfold.ir.dialects.moe import exchange_axes as exchange_axes_of
from meshfold.ir.dialects.ring import RANK_ARG
from meshfold.ir.dialects.scan import SCAN, SCAN_BACKWARD
from meshfold.ir.graph import Arg
from meshfold.ir.ops import OFFLOAD, RELOAD, WAIT
from meshfold.passes.sharding.rules.operands import int_arg, norm_dim, op_arg

aten = torch.ops.aten
OP_META = "meshfold_op"
"""The key of an fx node's ``meta`` naming the IR op it was lowered from (for errors about it)."""


@dataclass(frozen=True)
class RankContext:
    """What lowering needs to know about this rank: mesh sizes, its coordinate, group names."""

    mesh: ir.Mesh
    coordinate: tuple[int, ...]
    group_names: tuple[str, ...]
    flat_groups: tuple[tuple[tuple[str, ...], str], ...] = ()
    """Groups over several mesh axes at once (``exchange_axes`` says which a graph needs)."""
    gloo: bool = False
    """Whether the collectives run on gloo (CPU tensors): all-gathers and reduce-scatters are then
    sent as all-to-alls (``comm.issue``'s ``gloo``)."""
    cp_method: str = "ring"
    """How an attention split along the sequence runs (``passes.cp.CpSpec``): ``ring`` attention or
    ``tokenring``."""

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
    """With ``record``: values the backward module returns after the gradients (and the ``handoff``)."""
    weights: fx.GraphModule | None = None
    """With ``first``: the rest of the backward (``weight_outputs``' gradients), run after
    ``backward``; it takes the saved values, the tangents, then the ``handoff`` values ``backward``
    returns after its gradients."""
    weight_outputs: tuple[str, ...] = ()
    handoff: int = 0
    weight_recorded: tuple[Value, ...] = ()
    """With ``record`` and ``weights``: values ``weights`` returns after its gradients."""


def lower(graph: Graph, rank: RankContext, *, record: bool = False, rng: torch.Generator | None = None) -> Lowered:
    """Split ``graph`` by phase and lower both halves for ``rank``.

    ``record``: each module also returns, after its usual results, the local value of every tensor
    its ops produce (``Lowered.fwd_recorded`` / ``bwd_recorded`` say which), for verification.
    ``rng``: the generator the program's random ops draw from (``backends/random.py``; default: this
    process's default generator, which gives every rank the same values only when all are seeded alike).
    """
    ph = phases(graph)
    fwd_inputs, fwd_out, grads, tangents, saved = ph.fwd_inputs, ph.fwd_out, ph.grads, ph.tangents, ph.saved
    fwd_rec = recorded_values(ph.fwd_ops) if record else []
    bwd_rec = recorded_values(ph.bwd_ops) if record else []
    gen = rng if rng is not None else torch.default_generator
    fwd_results = [o.value for o in fwd_out] + saved + fwd_rec
    forward = build_module([i.value for i in fwd_inputs], ph.fwd_ops, fwd_results, rank, gen)
    backward = build_module(
        saved + [i.value for i in tangents], ph.bwd_ops, [o.value for o in grads] + bwd_rec, rank, gen, len(grads)
    )
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


def build_module(
    inputs: Sequence[Value],
    ops: Sequence[Op],
    outputs: Sequence[Value],
    rank: RankContext,
    rng: torch.Generator,
    distinct: int = 0,
) -> fx.GraphModule:
    """An fx module computing ``outputs`` from ``inputs`` by ``ops`` on this rank. The first ``distinct``
    outputs are distinct tensors: a value returned twice (one gradient of two parameters, as the
    output biases of a parallel-residual block get once common-subexpression elimination merged
    their sums) is cloned for each repeat."""
    g = fx.Graph()
    env: dict[Value, fx.Node] = {}
    for k, v in enumerate(inputs):
        env[v] = g.placeholder(f"in{k}")
    # NOTE: a collective a comm.wait reads is issued where it stands and finished at the wait
    started = {op.operands[0]: op for op in ops if op.target == WAIT}
    pending: dict[Op, tuple[Op, Issued]] = {}
    for op in ops:
        last = g._root.prev  # NOTE: the node before this op's; its collectives' waits are named after it
        if op.results and op.results[0] in started:
            pending[started[op.results[0]]] = (op, _issue(g, op, env, rank))
            continue
        if op.target == WAIT:
            start, issued = pending.pop(op)
            outs = issued.complete(g)
            if start.target != RELOAD:  # NOTE: a reload waits on this rank's copy engine, no peer
                _watched(g, last, start, rank)
        else:
            outs = _emit(g, op, env, rank, LOCAL, rng)
            if isinstance(op.target, OpDef) or op.target in _EXCHANGES:
                _watched(g, last, op, rank)
        for node in _after(last):
            node.meta[OP_META] = op
        for r, node in zip(op.results, outs, strict=True):
            env[r] = node
    # NOTE: gradients accumulate and scale in place (``.grad +=``, a pipeline's microbatches, clipping): two
    # parameters whose ``.grad`` shared one tensor would each change the other's
    results = [env[v] for v in outputs]
    for k in range(distinct):
        if results[k] in results[:k]:
            results[k] = g.call_function(aten.clone.default, (results[k],))
    g.output(tuple(results))
    g.lint()
    return fx.GraphModule(torch.nn.Module(), g)


def _watched(g: fx.Graph, last: fx.Node, op: Op, rank: RankContext) -> None:
    """Name ``op`` (and its mesh axes) in the error its collectives raise when a peer is stuck or gone."""
    axes = [str(op.kwarg("axis"))] if isinstance(op.target, OpDef) else list(exchange_axes_of(op))
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
    if op.target in _TIERS:
        return [g.call_function(_TIERS[op.target], (env[op.operands[0]],))]
    if isinstance(op.target, OpDef):
        return _issue(g, op, env, rank).complete(g)
    if is_random(op):
        site = random_site(op, rng, rank.mesh, rank.coordinate)
        node = g.call_function(site, tuple(_load(a, env) for a in op.args), {k: _load(v, env) for k, v in op.kwargs})
        return _unpacked(g, op, node)
    args, kwargs = table.local_args(op, rank.mesh)
    if op.target in RANK_ARG:
        args = _ranked(op, args, rank)
    own = _split_scan(op, rank) or _ring_call(op, rank)
    if own is not None:  # NOTE: an op that communicates itself along a split dim
        fn, head = own
        loaded = (_load(a, env) for a in args)
        node = g.call_function(fn, (*head, *loaded), {k: _load(v, env) for k, v in kwargs.items()})
        return _unpacked(g, op, node)
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


def _issue(g: fx.Graph, op: Op, env: dict[Value, fx.Node], rank: RankContext) -> Issued:
    if op.target == RELOAD:  # NOTE: the copy issued here, waited for at its comm.wait
        return Issued(g.call_function(reload_start, (env[op.operands[0]],)), lambda g, out: [out], wait=reload_wait)
    axis = str(op.kwarg("axis"))
    xs = [env[x] for x in op.operands]
    local = local_shapes(op, rank.mesh)
    return issue(g, op, xs, rank.size(axis), rank.group(axis), rank.coord(axis), local, gloo=rank.gloo)


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


# NOTE: the ops that exchange tokens themselves (their operands: ``ir.dialects.moe.TOKENS_AND_WEIGHTS``).
_EXCHANGES = {EXPERTS: exchange_forward, EXPERTS_BACKWARD: exchange_backward}
_TIERS = {OFFLOAD: offload, RELOAD: reload}
"""``mem.*``: an activation to the host tier and back (``backends/host_tier.py``)."""


def exchange_axes(graph: Graph) -> list[tuple[str, ...]]:
    """The multi-axis groups lowering ``graph`` needs (see ``RankContext.flat_groups``)."""
    out: list[tuple[str, ...]] = []
    for op in graph.ops:
        axes = exchange_axes_of(op)
        if len(axes) > 1 and axes not in out and op.args[-1] != "hierarchical":
            out.append(axes)
        along = _along_split(op, graph.mesh.names) if graph.mesh is not None else ()
        if len(along) > 1 and along not in out:
            out.append(along)
    return out


_SPLIT: dict[Any, Any] = {
    SCAN: affine_scan_split,
    SCAN_BACKWARD: affine_scan_backward_split,
    CONV: causal_conv1d_split,
    CONV_BACKWARD: causal_conv1d_backward_split,
}


def _along_split(op: Op, names: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes (in mesh order) that split the dim a running sum, linear recurrence or causal
    convolution runs along (which it then runs across itself); empty for any other op."""
    if op.target in _SPLIT:
        x = op.operands[1 if op.target == CONV_BACKWARD else 0]
        assert isinstance(x.type, TensorType)
        dim = x.type.rank - 3 if op.target in (SCAN, SCAN_BACKWARD) else 2
    elif op.target == aten.cumsum.default:
        x = op.operands[0]
        assert isinstance(x.type, TensorType)
        dim = norm_dim(int_arg(op, "dim", 0), x.type.rank)
    else:
        return ()
    return tuple(a for a in names if x.layout.placement(a) == ir.Shard(dim))


def _split_scan(op: Op, rank: RankContext) -> tuple[Any, tuple[Any, ...]] | None:
    """A running sum, flip, linear recurrence or causal convolution along a dim split over mesh axes:
    its function and the process group it runs across (a dim split over several axes: the group over
    all of them, whose ranks hold its pieces in order), or the flip's per-axis groups; None for any
    other op, and for those along whole dims."""
    axes = _along_split(op, rank.mesh.names)
    if axes and op.target in (CONV, CONV_BACKWARD):
        x, w = op.operands[1:3] if op.target == CONV_BACKWARD else op.operands[:2]
        assert isinstance(x.type, TensorType) and isinstance(w.type, TensorType)
        part, reach = x.layout.local_shape(x.type.shape, rank.mesh)[2], int(w.type.shape[-1]) - 1
        if isinstance(part, int) and part < reach:
            raise ValueError(
                f"{op.describe()}: each rank holds {part} positions of the sequence, fewer than the convolution "
                f"reaches back ({reach}); use fewer ranks on {' x '.join(axes)} or a longer sequence"
            )
    if axes:
        fn = cumsum_split if op.target == aten.cumsum.default else _SPLIT[op.target]
        return fn, (rank.group_over(axes),)
    if op.target != aten.flip.default:
        return None
    x = op.operands[0]
    assert isinstance(x.type, TensorType)
    dims = op_arg(op, "dims")
    assert isinstance(dims, (list, tuple))
    along = {norm_dim(int(d), x.type.rank) for d in dims}
    flipped = [a for a in rank.mesh.names if isinstance(p := x.layout.placement(a), ir.Shard) and p.dim in along]
    return (flip_split, (tuple(rank.group(a) for a in flipped),)) if flipped else None


def _ring_call(op: Op, rank: RankContext) -> tuple[Any, tuple[Any, ...]] | None:
    """An attention kernel run as ring attention (or TokenRing) over the process group of the mesh
    axis its queries are split along their sequence on (``rules.attention.ring_strategy``): the
    kernel and its leading arguments (the group and the method); None for any other op."""
    if op.target not in RING_KERNELS:
        return None
    q = op.operands[1 if RING_KERNELS[op.target] is ring_kernel_backward else 0]  # NOTE: after grad_out
    assert isinstance(q.type, TensorType)
    seq = ir.Shard(q.type.rank - 2)
    axes = [a for a in rank.mesh.names if q.layout.placement(a) == seq]
    assert len(axes) <= 1, f"{op.describe()}: a sequence split over several mesh axes has no ring"
    return (RING_KERNELS[op.target], (rank.group(axes[0]), rank.cp_method)) if axes else None


def _ranked(op: Op, args: tuple[Any, ...], rank: RankContext) -> tuple[Any, ...]:
    """A ring step's arguments with this rank's coordinate on the axis its queries' sequence is split
    over (``ir.dialects.ring``: the IR holds -1 there, every rank's part)."""
    x = op.operands[0]  # NOTE: every tensor of a ring step is held alike (``rules.attention``)
    axes = [a for a in rank.mesh.names if x.layout.placement(a) == ir.Shard(2)]
    assert len(axes) == 1, f"{op.describe()}: a ring step's sequence is split over one mesh axis"
    at = RANK_ARG[op.target]
    return (*args[:at], rank.coord(axes[0]), *args[at + 1 :])


def _exchange_call(op: Op, rank: RankContext) -> tuple[Any, tuple[Any, ...]] | None:
    """The all-to-all dispatcher's function and its peer description, when ``op`` needs one."""
    axes = tuple(a for a in rank.mesh.names if a in exchange_axes_of(op))
    if not axes:
        return None
    fn = _EXCHANGES[op.target]
    _, weights = TOKENS_AND_WEIGHTS[op.target]
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
