"""Attention written out as ``softmax(Q Kᵀ · scale + mask) V`` (HF's "eager" attention, a hand
written attention) made one ``scaled_dot_product_attention`` call, in the forward graph dynamo
captures, before the backward is traced.

The two compute the same thing (the flash kernel's rounding is not eager's, as after any
reordering of a sum), but the one call is what the sharding rules know whole: it can be split by
sequence (ring attention, TokenRing), by heads or batch, and never holds the ``L x S`` weights. A
chain is fused only when nothing else reads its intermediate values (the weights a model returns
are left as they are) and its scale is a constant; dropout on the weights only with ``p == 0``
(the fused kernel's dropout would draw other random numbers). Softmax in another dtype than the
queries' (``softmax(..., dtype=torch.float32)`` of bf16 scores) is left as it is.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

_MATMULS = {torch.matmul, operator.matmul, torch.bmm}
_SOFTMAX = {F.softmax, torch.softmax, torch.nn.functional.softmax}
_DROPOUT = {F.dropout, torch.dropout}


def _val(n: Any) -> Any:
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


def _is(n: Any, functions: set[Any], method: str) -> bool:
    return isinstance(n, fx.Node) and (
        (n.op == "call_function" and n.target in functions) or (n.op == "call_method" and n.target == method)
    )


def _arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _only_user(n: fx.Node) -> fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _last_two(n: Any, ndim: int) -> bool:
    """Whether ``n`` transposes the last two dims of a tensor of ``ndim`` dims."""
    if not _is(n, {torch.transpose}, "transpose"):
        return False
    dims = {d % ndim for d in (_arg(n, 1, "dim0"), _arg(n, 2, "dim1")) if isinstance(d, int)}
    return dims == {ndim - 2, ndim - 1}


def _scores(n: Any) -> tuple[Any, Any, float] | None:
    """``(q, k, scale)`` when ``n`` is ``q @ kᵀ`` times (or over) a constant, else None."""
    scale = 1.0
    if _is(n, {operator.mul, torch.mul}, "mul") and isinstance(n.args[1], float | int):
        scale, n = float(n.args[1]), n.args[0]
    elif _is(n, {operator.truediv, torch.div}, "div") and isinstance(n.args[1], float | int):
        scale, n = 1.0 / float(n.args[1]), n.args[0]
    if not _is(n, _MATMULS, "matmul") or _only_user(n) is None:
        return None
    q, kt = n.args[0], n.args[1]
    qv = _val(q)
    if qv is None or qv.dim() != 4 or not _last_two(kt, 4):
        return None
    return q, kt.args[0], scale


def _fused_one(graph: fx.Graph, softmax: fx.Node) -> bool:
    """Fuse the chain around ``softmax`` if it is one (see the module doc)."""
    x = softmax.args[0]
    val = _val(x)
    dim = _arg(softmax, 1, "dim")
    if val is None or not isinstance(dim, int) or dim % val.dim() != val.dim() - 1:
        return False
    mask, found = None, _scores(x)
    if found is None and _is(x, {operator.add, torch.add}, "add") and _only_user(x) is not None:
        for i in (0, 1):  # NOTE: scores + mask, or mask + scores
            found, mask = _scores(x.args[i]), x.args[1 - i]
            if found is not None:
                break
    if found is None:
        return False
    q, k, scale = found
    dtype = _val(q).dtype
    if _arg(softmax, 2, "dtype") not in (None, dtype) or dtype not in (torch.float32, torch.float64):
        return False
    chain, at = [softmax], softmax
    while True:
        nxt = _only_user(at)
        if nxt is None:
            return False
        same = _is(nxt, set(), "to") and all(a == dtype for a in [*nxt.args[1:], *nxt.kwargs.values()])
        if same or (_is(nxt, _DROPOUT, "dropout") and _arg(nxt, 1, "p", 0.5) == 0.0):
            chain.append(nxt)
        elif _is(nxt, _MATMULS, "matmul") and nxt.args[0] is at:
            out, v = nxt, nxt.args[1]
            break
        else:
            return False
        at = nxt
    vv, kv = _val(v), _val(k)
    if vv is None or kv is None or vv.shape[:2] != _val(q).shape[:2] or kv.shape[:2] != _val(q).shape[:2]:
        return False
    with graph.inserting_before(out):
        fused = graph.call_function(
            F.scaled_dot_product_attention, (q, k, v), {"attn_mask": mask, "dropout_p": 0.0, "scale": scale}
        )
    fused.meta = dict(out.meta)
    out.replace_all_uses_with(fused)
    stack = [out]  # NOTE: the chain, from its end, and whatever only it read
    while stack:
        node = stack.pop()
        if not node.users and node.op in ("call_function", "call_method"):
            inputs = list(node.all_input_nodes)
            graph.erase_node(node)
            stack.extend(i for i in inputs if i not in (q, k, v, mask))
    return True


def fuse_attention(gm: fx.GraphModule) -> int:
    """Fuse every eager attention chain of dynamo's forward graph ``gm`` in place; how many."""
    fused = sum(_fused_one(gm.graph, n) for n in list(gm.graph.nodes) if _is(n, _SOFTMAX, "softmax"))
    if fused:
        gm.recompile()
    return fused
