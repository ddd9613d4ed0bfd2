"""Scaled dot-product attention, every ATen variant (math, CPU flash, CUDA flash, memory-efficient,
cuDNN, overrideable) and their backward forms.

Attention mixes whole sequences and whole head dims, so only the leading (batch, heads) dims of
``query [*B, L, E]`` shard; every tensor that carries them (key, value, output, gradients, the
logsumexp ``[*B, ...]``, a mask broadcast to ``[*B, L, S]``) shards alike. RNG state, cumulative
sequence offsets and debug tensors that do not carry them are Replicate; non-tensor results
(``max_q``) are Replicate.

One more strategy splits the sequence (``ring_strategy``): queries, keys, values, output, its
log-sum-exp and every gradient split along their sequence dim, computed as ring attention over the
axis's ranks (``backends/context_parallel/ring_attention.py``: keys and values passed round the ring, block results
merged by
their log-sum-exp). Only the CPU flash kernel's pair has it (the one the ring runs block by block),
and only without dropout; a mask splits by its query rows and keeps every key column (each block
reads its part). Which axes may use it is ``passes.cp``'s to say.

Ring attention's own steps (``meshfold.ring_step``, its backward and ``meshfold.lse_merge``; see
``ir.dialects.ring``), which ``passes/cp/steps.py`` writes after the solve in place of a sequence-split
attention, hold one layout on every operand and result, batch, heads or sequence split alike (the
step's own ranks pass the keys by ``comm.ppermute``, not by a layout change).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

import torch
from torch._ops import OpOverload

from meshfold.ir import Op, Partial, Placement, R, Shard, TensorType
from meshfold.ir.dialects.ring import LSE_MERGE, RING_STEP, RING_STEP_BACKWARD
from meshfold.passes.sharding.cost import nbytes
from meshfold.passes.sharding.rules.operands import (
    einsum_of,
    letters,
    op_arg,
    operand_names,
    replicate_non_tensor_results,
    tensor_type_of,
)
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies

aten = torch.ops.aten
RULES = RuleSet("attention")

Role = Literal["qkv", "lse", "bias", "bias_grad", "full", "rep"]

# NOTE: roles of operands come from their schema argument names, roles of results from their
# position; a new variant needs one entry here and nothing else.
OPERAND_ROLES: Mapping[str, Role] = MappingProxyType(
    {
        "query": "qkv",
        "key": "qkv",
        "value": "qkv",
        "grad_out": "qkv",
        "grad_out_": "qkv",
        "out": "qkv",
        "logsumexp": "lse",
        "attn_mask": "bias",
        "attn_bias": "bias",
        "dropout_mask": "full",
    }
)
_FWD_FUSED: tuple[Role, ...] = ("qkv", "lse", "rep", "rep", "rep", "rep", "rep", "rep", "full")
RESULT_ROLES: Mapping[OpOverload, tuple[Role, ...]] = MappingProxyType(
    {
        aten.scaled_dot_product_attention.default: ("qkv",),
        aten._scaled_dot_product_attention_math.default: ("qkv", "full"),
        aten._scaled_dot_product_flash_attention_for_cpu.default: ("qkv", "lse"),
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ("qkv", "qkv", "qkv"),
        aten._scaled_dot_product_efficient_attention.default: ("qkv", "lse", "rep", "rep"),
        aten._scaled_dot_product_efficient_attention_backward.default: ("qkv", "qkv", "qkv", "bias_grad"),
        aten._scaled_dot_product_flash_attention.default: _FWD_FUSED,
        aten._scaled_dot_product_flash_attention_backward.default: ("qkv", "qkv", "qkv"),
        aten._scaled_dot_product_cudnn_attention.default: _FWD_FUSED,
        aten._scaled_dot_product_cudnn_attention_backward.default: ("qkv", "qkv", "qkv"),
        aten._scaled_dot_product_fused_attention_overrideable.default: _FWD_FUSED,
        aten._scaled_dot_product_fused_attention_overrideable_backward.default: ("qkv", "qkv", "qkv", "bias_grad"),
    }
)


def _group(t: TensorType | None, role: Role, q: TensorType, batch: list[str]) -> tuple[str, ...]:
    """Dim letters of one tensor: the batch letters where it has them, ``_`` elsewhere."""
    if t is None or role == "rep":
        return ()
    nb = len(batch)
    whole = tuple("_" for _ in range(t.rank))
    if role in ("qkv", "full"):
        if t.rank != q.rank:
            return whole
        lead = tuple("_" if (t.shape[d] == 1 and q.shape[d] != 1) else batch[d] for d in range(nb))
        return (*lead, "_", "_")
    if role == "lse":
        return tuple(batch[d] if d < nb else "_" for d in range(t.rank)) if t.rank >= nb else whole
    # bias / bias_grad: right-aligned to [*B, L, S], size-1 (broadcast) dims whole
    offset = q.rank - t.rank
    return tuple(
        "_" if (d + offset < 0 or d + offset >= nb or t.shape[d] == 1) else batch[d + offset] for d in range(t.rank)
    )


@RULES.rule(*RESULT_ROLES)
def attention(op: Op) -> list[Strategy]:
    """``b h _ _, b h _ _, b h _ _ -> b h _ _, b h _`` (query, key, value -> output, logsumexp; masks
    ``b _ _ _`` when broadcast over heads): batch and heads shard, sequence and head dims never;
    no Partial passes. A bias gradient whose dim is broadcast (size 1) is not sharded on it."""
    target = op.target
    assert isinstance(target, OpOverload)
    names = operand_names(op)
    q = tensor_type_of(op.operands[names.index("query")])
    assert q is not None, f"{op.describe()}: query is not a tensor"
    batch = letters(max(q.rank - 2, 0))
    ins = [
        _group(tensor_type_of(v), OPERAND_ROLES.get(name, "rep"), q, batch)
        for v, name in zip(op.operands, names, strict=True)
    ]
    roles = RESULT_ROLES[target]
    outs = [
        _group(tensor_type_of(r), roles[i] if i < len(roles) else "rep", q, batch) for i, r in enumerate(op.results)
    ]
    strategies = replicate_non_tensor_results(op, einsum_strategies(einsum_of(ins, outs)))
    # NOTE: a Partial result can only come from a bias gradient reduced over a broadcast dim; the
    # kernels' reduction there is not documented, so such strategies are dropped.
    kept = [s for s in strategies if not any(isinstance(p, Partial) for p in s.outputs)]
    ring = ring_strategy(op)
    return kept if ring is None else [*kept, ring]


# NOTE: the kernels ring attention runs block by block (the CPU flash pair), forward then backward
RING_KERNELS = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)


def ring_blocker(op: Op) -> str | None:
    """Why attention ``op`` cannot be split by sequence (ring attention), or None when it can."""
    if op.target not in RING_KERNELS:
        return f"its kernel {op.target} is not one ring attention runs block by block (the CPU flash kernel)"
    if op_arg(op, "dropout_p", 0.0) != 0.0:
        return "it applies dropout, whose mask ring attention does not reproduce"
    return None


def ring_strategy(op: Op) -> Strategy | None:
    """Every tensor split along its sequence dim (the queries' second-to-last), a mask by its query
    rows (unless broadcast over them) with every key column whole, priced by the keys and values
    (and, backward, their gradients) passed once round the ring; None when the op has no ring form
    (``ring_blocker``)."""
    if ring_blocker(op) is not None:
        return None
    names = operand_names(op)
    q = tensor_type_of(op.operands[names.index("query")])
    assert q is not None
    seq = Shard(q.rank - 2)
    ins: list[Placement] = []
    kv = 0.0
    for name, v in zip(names, op.operands, strict=True):
        t = tensor_type_of(v)
        if name == "attn_mask":
            ins.append(Shard(t.rank - 2) if t is not None and t.rank >= 2 and t.shape[-2] != 1 else R)
            continue
        ins.append(seq)
        kv += nbytes(t) if t is not None and name in ("key", "value") else 0.0
    backward = op.target == RING_KERNELS[1]
    return Strategy(tuple(ins), tuple(seq for _ in op.results), passed=kv * (2.0 if backward else 1.0))


@RULES.rule(RING_STEP, RING_STEP_BACKWARD, LSE_MERGE)
def ring_step(op: Op) -> list[Strategy]:
    """Every tensor ``[batch, heads, seq, ...]`` held alike: whole, or split along dim 0, 1 or 2."""
    ins, outs = len(op.operands), len(op.results)
    return [Strategy((p,) * ins, (p,) * outs) for p in (R, Shard(0), Shard(1), Shard(2))]
