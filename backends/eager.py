"""Lower a boxed SPMD graph to one rank's forward and backward ``fx.GraphModule``s.

Types in the IR are global; here each value gets its local shape from its layout
(``Layout.local_shape``), shape-spelling arguments are rewritten and ranged ops run on their slice
as ``backends/local.py`` says, and ``comm.*`` ops become
``torch.ops._c10d_functional`` collectives (+ ``wait_tensor``) on the mesh's process groups.
Each op lowers through the lowering table (``backends/lowering/lowerings.py``: which ops lower how).
The joint graph is split by phase: forward ops form the forward module, which also returns the
values the backward needs ("saved"); backward ops form the backward module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from meshfold.backends.collectives import Issued
from meshfold.backends.experts.dispatch import exchange_forward
from meshfold.backends.local import LOCAL
from meshfold.backends.lowering.emit import EmitContext
from meshfold.backends.lowering.emit import RankContext as RankContext
from meshfold.backends.lowering.lowerings import EXCHANGES, LOWERINGS, along_split, issue_op
from meshfold.backends.phases import phases, recorded_values
from meshfold.backends.watch import Watch, watch_waits
from meshfold.ir import Graph, Op, OpDef, Value
from meshfold.ir.dialects.moe import exchange_axes as exchange_axes_of
from meshfold.ir.ops import RELOAD, WAIT

aten = torch.ops.aten
OP_META = "meshfold_op"
"""The key of an fx node's ``meta`` naming the IR op it was lowered from (for errors about it)."""


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
    ctx = EmitContext(g, env, rank, LOCAL, rng)
    for k, v in enumerate(inputs):
        env[v] = g.placeholder(f"in{k}")
    # NOTE: a collective a comm.wait reads is issued where it stands and finished at the wait
    started = {op.operands[0]: op for op in ops if op.target == WAIT}
    pending: dict[Op, tuple[Op, Issued]] = {}
    for op in ops:
        last = g._root.prev  # NOTE: the node before this op's; its collectives' waits are named after it
        if op.results and op.results[0] in started:
            pending[started[op.results[0]]] = (op, issue_op(ctx, op))
            continue
        if op.target == WAIT:
            start, issued = pending.pop(op)
            outs = issued.complete(g)
            if start.target != RELOAD:  # NOTE: a reload waits on this rank's copy engine, no peer
                _watched(g, last, start, rank)
        else:
            outs = LOWERINGS.lower(ctx, op)
            if isinstance(op.target, OpDef) or op.target in EXCHANGES:
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


def exchange_axes(graph: Graph) -> list[tuple[str, ...]]:
    """The multi-axis groups lowering ``graph`` needs (see ``RankContext.flat_groups``)."""
    out: list[tuple[str, ...]] = []
    for op in graph.ops:
        axes = exchange_axes_of(op)
        if len(axes) > 1 and axes not in out and op.args[-1] != "hierarchical":
            out.append(axes)
        along = along_split(op, graph.mesh.names) if graph.mesh is not None else ()
        if len(along) > 1 and along not in out:
            out.append(along)
    return out
