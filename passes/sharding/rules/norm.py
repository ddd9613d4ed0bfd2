"""Normalizations: ``native_layer_norm`` and ``_fused_rms_norm`` over trailing dims, softmax and
log-softmax along one dim, with their backward forms.

The normalized (trailing) dims stay whole; the leading (batch) dims shard on the input, the
statistics and the outputs alike. Parameter gradients sum over the batch, so a sharded batch dim
makes them ``P(sum)``.

The softmax dim needs every element (a normalizer over the whole dim), so it stays whole (``_``)
and is never sharded; every other dim shards alike on all operands.
"""

from __future__ import annotations

import torch

from meshfold.ir import Op, Value
from meshfold.passes.sharding.rules.operands import (
    einsum_of,
    int_arg,
    letters,
    norm_dim,
    op_arg,
    operand_names,
    replicate_non_tensor_results,
    result_type,
    tensor_type_of,
)
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies, replicate_only

aten = torch.ops.aten
RULES = RuleSet("norm")


def _batch_rank(op: Op) -> int:
    t = tensor_type_of(op.operands[0])
    assert t is not None, f"{op.describe()}: input is not a tensor"
    shape = op_arg(op, "normalized_shape", ())
    return t.rank - (len(shape) if isinstance(shape, tuple) else 0)


def _group(v: Value, batch: list[str]) -> tuple[str, ...]:
    """Leading ``batch`` letters, ``_`` for the rest; a parameter (no batch dims) is all ``_``."""
    t = tensor_type_of(v)
    if t is None:
        return ()
    return tuple(batch[d] if d < len(batch) else "_" for d in range(t.rank))


def _strategies(op: Op, activations: set[str], *, grad_linear: bool) -> list[Strategy]:
    """Operands named in ``activations`` carry the batch dims; the other tensors are parameters."""
    batch = letters(_batch_rank(op))
    names = operand_names(op)
    rows = [v for v, n in zip(op.operands, names, strict=True) if n in activations]
    rows += [r for i, r in enumerate(op.results) if i == 0 or _is_stat(op, i)]
    # NOTE: statistics are [*batch, 1, ...]; any other layout (an old flattened [M]) is not ours to guess.
    if any((t := tensor_type_of(v)) is not None and t.rank < len(batch) for v in rows):
        return replicate_only(len(op.operands), len(op.results))
    ins = [_group(v, batch) if n in activations else _group(v, []) for v, n in zip(op.operands, names, strict=True)]
    outs = [_group(r, batch) if i == 0 or _is_stat(op, i) else _group(r, []) for i, r in enumerate(op.results)]
    e = einsum_of(ins, outs)
    return replicate_non_tensor_results(op, einsum_strategies(e, linear=(0,) if grad_linear else ()))


def _is_stat(op: Op, i: int) -> bool:
    """Forward results after the output are per-row statistics (mean, rstd)."""
    return op.target in (aten.native_layer_norm.default, aten._fused_rms_norm.default) and i > 0


@RULES.rule(aten.native_layer_norm.default, aten._fused_rms_norm.default)
def norm_forward(op: Op) -> list[Strategy]:
    """``a b _, _, _ -> a b _, a b _, a b _`` (input, weight, bias -> out, mean, rstd): normalized
    dims whole; no Partial passes (normalization is not linear)."""
    return _strategies(op, {"input"}, grad_linear=False)


@RULES.rule(aten.native_layer_norm_backward.default, aten._fused_rms_norm_backward.default)
def norm_backward(op: Op) -> list[Strategy]:
    """``a _, a _, a _, a _, _, _ -> a _, _, _`` (grad_out, input, mean, rstd, weight, bias ->
    grad_input, grad_weight, grad_bias): a sharded batch dim makes parameter gradients ``P(sum)``;
    linear in ``grad_out`` (every result then Partial); masked-off results are Replicate."""
    return _strategies(op, {"grad_out", "input", "mean", "rstd"}, grad_linear=True)


def _softmax_spec(op: Op) -> list[str]:
    t = result_type(op)
    g = letters(t.rank)
    if t.rank:
        g[norm_dim(int_arg(op, "dim", -1), t.rank)] = "_"
    return g


@RULES.rule(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax(op: Op) -> list[Strategy]:
    """``a _ -> a _`` for ``dim=1``: the softmax dim stays whole; not linear, so no Partial."""
    g = _softmax_spec(op)
    return einsum_strategies(einsum_of([g], [g]))


@RULES.rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward(op: Op) -> list[Strategy]:
    """``a _, a _ -> a _`` (grad_output, output): softmax dim whole; linear in ``grad_output``
    (``y * (g - sum(g * y))`` and ``g - exp(y) * sum(g)``), so its ``P(sum)``/``P(avg)`` pass."""
    g = _softmax_spec(op)
    return einsum_strategies(einsum_of([g, g], [g]), linear=(0,))
