"""A causal convolution written as ``conv1d(x, w, bias, padding=K - 1, groups=C)[..., :L]`` (one
filter per channel, padded on both sides and cut back to the sequence: HF's reference for the short
convolutions before Mamba's and the gated DeltaNet's scans) made one ``meshfold.causal_conv1d``, in
the forward graph dynamo captures, before the backward is traced.

The two compute the same; the one op is what the sharding rules know whole: its sequence may stay
split, each rank taking the ``K - 1`` positions before its part from its neighbour, where the
padded convolution's output (``L + K - 1`` positions) splits no way. A convolution without a bias
gets a zero one. Any other convolution is left as it is.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from meshfold.ir.dialects.conv import CONV

_CONV1D = {torch.conv1d, F.conv1d}


def _example(n: Any) -> torch.Tensor | None:
    v = n.meta.get("example_value") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _single(v: Any, default: int) -> int | None:
    if v is None:
        return default
    if isinstance(v, (tuple, list)) and len(v) == 1:
        v = v[0]
    return v if type(v) is int else None


def _arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _cut_to(user: fx.Node, length: int) -> bool:
    """``user`` is ``conv[..., :length]`` (or ``conv[:, :, :length]``)."""
    if user.op != "call_function" or user.target is not operator.getitem:
        return False
    idx = user.args[1]
    keep = slice(None, length, None), slice(0, length, None)
    return isinstance(idx, tuple) and idx[-1] in keep and all(s in (slice(None), Ellipsis) for s in idx[:-1])


def fuse_causal_convs(gm: fx.GraphModule) -> int:
    """Rewrite every causal convolution in ``gm`` (module docstring); returns how many."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _CONV1D or len(n.users) != 1:
            continue
        x, w, bias = _arg(n, 0, "input"), _arg(n, 1, "weight"), _arg(n, 2, "bias")
        tx, tw, user = _example(x), _example(w), next(iter(n.users))
        if tx is None or tw is None or tx.dim() != 3 or tw.dim() != 3 or tx.dtype != tw.dtype:
            continue
        c, k = tx.shape[1], tw.shape[-1]
        plain = _single(_arg(n, 3, "stride"), 1) == 1 and _single(_arg(n, 5, "dilation"), 1) == 1
        shaped = tuple(tw.shape[:2]) == (c, 1) and _arg(n, 6, "groups", 1) == c
        causal = _single(_arg(n, 4, "padding"), 0) == k - 1 and _cut_to(user, tx.shape[-1])
        if not (plain and shaped and causal and (bias is None or _example(bias) is not None)):
            continue
        with gm.graph.inserting_before(user):
            if bias is None:
                bias = gm.graph.call_function(torch.zeros, (c,), {"dtype": tx.dtype, "device": tx.device})
                bias.meta = dict(n.meta)
            fused = gm.graph.call_function(CONV, (x, w, bias))
        fused.meta = dict(user.meta)
        user.replace_all_uses_with(fused)
        gm.graph.erase_node(user)
        gm.graph.erase_node(n)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
