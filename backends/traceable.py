"""A rank's lowered program made plain for a backend that traces it again (Inductor, the ONNX exporter).

``backends/eager.py`` builds each module from ATen ops, ``torch.ops._c10d_functional`` collectives
and a few Python helpers; a tracer takes the ops and the helpers made of them (``PURE``), follows
each ``Watch`` to the function it wraps, and cannot take a helper that calls process groups, files
or meshfold's generator itself. :func:`plain` makes the copy a tracer gets and refuses, before
anything runs, a program holding such a helper, naming the op it lowers.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx as fx

from meshfold.backends.eager import OP_META
from meshfold.backends.experts.dispatch import EXCHANGE_OPS, flat_exchange_args
from meshfold.backends.random import RandomSite, as_random_call
from meshfold.backends.watch import Watch
from meshfold.passes.base import PassError

PURE = ("meshfold.backends.collectives", "meshfold.backends.local", "meshfold.backends.context_parallel.split_scans")
"""Modules whose helpers a lowered program calls that are ATen ops and functional collectives only:
a tracer follows them like the ops around them."""
REFUSED = {
    "meshfold.backends.host_tier": "copies activations to and from host files",
    "meshfold.backends.random": "draws from meshfold's own generator, which traced random ops do not take",
}
"""Modules whose helpers no tracer can take, and why (anything else outside ``PURE``: it calls
process groups directly)."""

EXCHANGE = {
    "meshfold.backends.experts.dispatch": "exchanges tokens between expert ranks in amounts known only while it runs"
}
"""The reason a backend that takes no opaque op (``exchange_op=False``) gives for the MoE token exchange."""


def plain(
    module: fx.GraphModule,
    cannot: str,
    advice: str,
    *,
    exchange_op: bool = True,
    random_op: bool = False,
    refused: Mapping[str, str] | None = None,
) -> fx.GraphModule:
    """``module`` with every ``Watch`` unwrapped and, with ``exchange_op``, each MoE token exchange as
    its custom op (``backends.experts.dispatch.EXCHANGE_OPS``); with ``random_op``, each random op as the custom
    op ``meshfold::random_call`` (``backends.random``), which draws as the eager program does.
    Raises ``PassError`` naming the op, its module path and source line where a call is none of
    these: a helper of a module in ``REFUSED`` or ``refused`` (which gives the backend's own
    reasons), or one outside ``PURE``; the message is ``cannot`` (who cannot take what:
    "backend='inductor' cannot compile"), the op, why, ``advice``."""
    why = {**REFUSED, **(refused or {})}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in module.graph.nodes:
        copy = graph.node_copy(node, lambda n: env[n])
        if isinstance(copy.target, Watch):
            copy.target = copy.target.fn
        if exchange_op and copy.target in EXCHANGE_OPS:
            copy.args = flat_exchange_args(copy.args)
            copy.target = EXCHANGE_OPS[copy.target]  # type: ignore[index]
        if random_op and isinstance(copy.target, RandomSite):
            copy = _random_call(graph, copy)
        if copy.op == "call_function":
            _check(copy, why, cannot, advice)
        env[node] = copy
    return fx.GraphModule(module, graph)


def _random_call(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``node`` (a ``RandomSite`` call) as a ``meshfold::random_call`` node, its result as before."""
    assert isinstance(node.target, RandomSite)
    args, returns_tuple = as_random_call(node.target, node.args, dict(node.kwargs))
    with graph.inserting_after(node):
        call = graph.call_function(torch.ops.meshfold.random_call.default, args)
        call.meta = dict(node.meta)
    if returns_tuple:
        result = call
    else:
        with graph.inserting_after(call):
            result = graph.call_function(operator.getitem, (call, 0))
    graph.erase_node(node)
    return result


def _check(node: fx.Node, refused: Mapping[str, str], cannot: str, advice: str) -> None:
    target = node.target
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket) or target is operator.getitem:
        return
    where = getattr(target, "__module__", "") or ""
    if where in PURE:
        return
    name = getattr(target, "__name__", type(target).__name__)
    why = refused.get(where, "calls process groups directly, which a tracer cannot follow")
    op = node.meta.get(OP_META)
    at = op.describe() if op is not None else node.name
    raise PassError(f"{cannot} {at}: its lowering ({where}.{name}) {why}. {advice}")
