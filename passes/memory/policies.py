"""Which forward values each recompute policy makes again in the backward, per block.

* ``full``: a block (``layers.3``) from its input: everything its recomputable ops make except what
  ops outside the block read (its outputs) and the graph's outputs;
* ``selective``: the core of each attention (the module that calls the attention kernel, without
  its projections): rotary embedding, the K/V repeat of grouped-query attention, the kernel's own
  results, recomputed from the Q/K/V projections' outputs, which are kept (Megatron's
  ``core_attn`` recompute);
* ``kv``: only the key and value path: the K/V projections (``k_proj``, ``v_proj``, ``kv_b_proj``)
  and what the attention module computes from them alone (rotary, repeat), recomputed from the
  projections' kept input (Pangu Ultra MoE's K/V-only recompute).

Module paths and the ATen attention kernels name the parts; a model without them (a fused QKV
projection for ``kv``) has nothing to recompute under that policy.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from meshfold.ir import Graph, Op, OpDef, Value
from meshfold.passes.blocks import op_blocks
from meshfold.passes.memory.recompute import overwritten_buffers, recomputable

POLICIES = ("full", "selective", "kv")
ANSWERS = ("save", "recompute", "offload")
"""What a per-value policy (``parallelize(memory=fn)``) answers for each ``Saved``."""


@dataclass(frozen=True)
class Saved:
    """One activation the forward hands to the backward, as a per-value policy sees it: the value's
    name, the module path and ATen op that make it, its bytes on one rank, and whether running that
    op again gives the same numbers (no mutation, no random draw)."""

    name: str
    module: str
    op: str
    nbytes: int
    recomputable: bool


_KV = re.compile(r"(^|_)(k|v|kv)(_|$)")
_GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution"})


def policy_values(graph: Graph, policy: str) -> dict[str, set[Value]]:
    """Per block, the forward values ``policy`` recomputes (see the module doc)."""
    labels = op_blocks(graph)
    fwd = [(op, b) for op, b in zip(graph.ops, labels, strict=True) if op.prov.phase == "fwd"]
    attention = {op.prov.module for op, _ in fwd if _is_attention(op)}
    overwritten = overwritten_buffers(graph)
    chosen: dict[str, set[Value]] = defaultdict(set)
    if policy == "full":
        for op, b in fwd:
            if b and recomputable(op, overwritten):
                chosen[b].update(op.results)
        return _inner(graph, fwd, chosen)
    if policy == "pointwise":  # NOTE: the budget's first stage, not a user policy
        for op, b in fwd:
            if b and recomputable(op, overwritten) and not _heavy(op):
                chosen[b].update(op.results)
        return _inner(graph, fwd, chosen)
    if policy == "selective":
        for op, b in fwd:
            if b and op.prov.module in attention and recomputable(op, overwritten):
                chosen[b].update(op.results)
        return _inner(graph, fwd, chosen)
    if policy != "kv":
        raise ValueError(f"unknown recompute policy {policy!r}; policies: {', '.join(POLICIES)}")
    keys: set[Value] = set()
    for op, b in fwd:
        leaf = op.prov.module.rsplit(".", 1)[-1]
        reads_kv = any(u in keys for u in op.operands)
        in_path = _KV.search(leaf) is not None or (op.prov.module in attention and reads_kv)
        if b and in_path and recomputable(op, overwritten) and not _is_attention(op):
            keys.update(op.results)
            chosen[b].update(op.results)
    return _inner(graph, fwd, chosen)


def _inner(graph: Graph, fwd: list[tuple[Op, str]], chosen: dict[str, set[Value]]) -> dict[str, set[Value]]:
    """``chosen`` less the values an op of another block reads (a block's outputs) and the graph's
    outputs."""
    owner = {v: b for b, vs in chosen.items() for v in vs}
    for op, b in fwd:
        for u in op.operands:
            if u in owner and owner[u] != b:
                chosen[owner[u]].discard(u)
    for o in graph.outputs:
        if o.value in owner:
            chosen[owner[o.value]].discard(o.value)
    return {b: vs for b, vs in chosen.items() if vs}


def _heavy(op: Op) -> bool:
    """A GEMM, an attention kernel, a collective or another of our ops: what the ``pointwise``
    stage keeps (everything else in a block is cheap to run again)."""
    parts = op.name.split(".")
    return isinstance(op.target, OpDef) or _is_attention(op) or (len(parts) > 1 and parts[1] in _GEMMS)


def _is_attention(op: Op) -> bool:
    """An attention kernel (the ``scaled_dot_product`` family)."""
    return "scaled_dot_product" in op.name
