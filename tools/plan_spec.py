"""A ``ModelSpec`` (what the cluster simulator prices) read off a PyTorch decoder-only transformer.

``meshfold plan --model`` takes zoo names and ``module:factory`` as well as HF configs: a model with
an HF ``.config`` is read from it; any other model is read from its modules. The reader finds the
token embedding (vocab, hidden), the ``nn.ModuleList`` of blocks (layers), the attention module (the
one with a heads attribute: ``n_heads`` / ``num_heads`` / ``num_attention_heads``, and
``n_kv_heads`` / ``num_key_value_heads``, ``head_dim`` when present), the MLP's linears and, in
blocks with routed experts (a module with ``experts`` and ``top_k``), the expert count and width.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from meshfold.sim import ModelSpec, from_hf_config

_HEADS = ("n_heads", "num_heads", "num_attention_heads", "n_head")
_KV_HEADS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")


def spec_of(made: Any, name: str) -> ModelSpec:
    """A ModelSpec from a ModelSpec, an HF config (dict or object), or an ``nn.Module`` (its ``.config``
    when it has an HF one, else its modules); ValueError says what is missing."""
    if isinstance(made, ModelSpec):
        return made
    config = getattr(made, "config", made)
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, Mapping):
        return from_hf_config(config, name=name)
    if isinstance(made, nn.Module):
        return spec_of_module(made, name)
    raise ValueError(
        f"--model {name}: got {type(made).__name__}; a factory returns (model, example_inputs), a ModelSpec or an "
        "HF config"
    )


def _attr(mod: nn.Module, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = getattr(mod, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _fail(name: str, what: str) -> ValueError:
    return ValueError(
        f"--model {name}: {what}; meshfold plan simulates decoder-only transformers (an nn.Embedding, an "
        "nn.ModuleList of blocks, attention with a heads attribute); pass an HF config .json for other models"
    )


def spec_of_module(model: nn.Module, name: str) -> ModelSpec:
    """Read a decoder-only transformer's dimensions off its modules (see the module docstring)."""
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeds:
        raise _fail(name, f"{type(model).__name__} has no nn.Embedding")
    tok = max(embeds, key=lambda m: m.num_embeddings)
    vocab, hidden = tok.num_embeddings, tok.embedding_dim
    positions = [m.num_embeddings for m in embeds if m is not tok and m.embedding_dim == hidden]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and any(map(_attention, m))]
    if not lists:
        raise _fail(name, f"{type(model).__name__} has no nn.ModuleList of blocks with attention")
    blocks = list(max(lists, key=len))
    attn = _attention(blocks[0])
    assert attn is not None
    heads = _attr(attn, _HEADS)
    assert heads is not None
    moes = [_moe(b) for b in blocks]
    dense = [b for b, m in zip(blocks, moes, strict=True) if m is None]
    first = next((m for m in moes if m is not None), None)
    experts = _experts(first) if first is not None else (0, 0, 0)
    ffn, gated = _mlp(dense[0], hidden) if dense else (experts[1], True)
    if first is not None and not dense:
        gated = True
    if not ffn:
        raise _fail(name, "no MLP found in the first block (linears from hidden to a wider size)")
    lm_weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    block0 = blocks[0]
    return ModelSpec(
        name=name,
        layers=len(blocks),
        hidden=hidden,
        heads=heads,
        ffn_hidden=ffn,
        vocab=vocab,
        kv_heads=_attr(attn, _KV_HEADS),
        head_dim=_attr(attn, ("head_dim",)),
        gated_mlp=gated,
        tied_embeddings=any(w is tok.weight for w in lm_weights),
        linear_bias=any(m.bias is not None for m in attn.modules() if isinstance(m, nn.Linear)),
        layernorm_bias=any(isinstance(m, nn.LayerNorm) and m.bias is not None for m in block0.modules()),
        learned_positions=max(positions, default=0),
        num_experts=experts[0],
        top_k=experts[2],
        moe_ffn_hidden=experts[1],
        shared_experts=_shared(first, experts[1]) if first is not None else 0,
        first_k_dense=next((i for i, m in enumerate(moes) if m is not None), 0),
    )


def _attention(block: nn.Module) -> nn.Module | None:
    """The first module in ``block`` with a heads attribute."""
    return next((m for m in block.modules() if _attr(m, _HEADS)), None)


def _moe(block: nn.Module) -> nn.Module | None:
    """The routed-experts module of ``block``: one with an ``experts`` child and a ``top_k``."""
    for m in block.modules():
        if hasattr(m, "experts") and (_attr(m, ("top_k",)) or _attr(getattr(m, "gate", m), ("top_k",))):
            return m
    return None


def _experts(moe: nn.Module) -> tuple[int, int, int]:
    """(expert count, expert intermediate width, top_k) of a routed-experts module."""
    top_k = _attr(moe, ("top_k",)) or _attr(moe.gate, ("top_k",)) or 0
    experts = moe.experts
    if isinstance(experts, nn.ModuleList):
        first = next(m for m in experts[0].modules() if isinstance(m, nn.Linear))
        return len(experts), first.out_features, top_k
    gate_up = getattr(experts, "gate_up_proj", None)
    if gate_up is None:
        raise ValueError(f"experts module {type(experts).__name__}: no gate_up_proj [E, 2I, H] and not a ModuleList")
    return int(gate_up.shape[0]), int(gate_up.shape[1]) // 2, top_k


def _shared(moe: nn.Module, width: int) -> int:
    """Always-on experts, counted in experts of ``width``."""
    shared = getattr(moe, "shared_experts", None)
    if not isinstance(shared, nn.Module) or not width:
        return 0
    widest = max((m.out_features for m in shared.modules() if isinstance(m, nn.Linear)), default=0)
    return max(1, widest // width)


def _mlp(block: nn.Module, hidden: int) -> tuple[int, bool]:
    """(intermediate width, gated) of a dense block's MLP: the linears from ``hidden`` outside attention."""
    attn = _attention(block)
    inside = {id(m) for m in attn.modules()} if attn is not None else set()
    widths = [
        m.out_features
        for m in block.modules()
        if isinstance(m, nn.Linear) and id(m) not in inside and m.in_features == hidden and m.out_features != hidden
    ]
    if not widths:
        return 0, False
    ffn = max(widths)
    return ffn, widths.count(ffn) >= 2
