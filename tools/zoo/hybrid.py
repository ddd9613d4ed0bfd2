"""A hybrid causal LM: linear attention (a running sum of key-value outer products) in the first
layer, softmax attention in the second, as hybrid linear/softmax models (MiniMax, Qwen3-Next) mix
them; and its gated variant, whose memory decays by a gate computed from each token (the scalar
decay per head of Mamba-2 and gated linear attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# NOTE: ``register`` adds an entry to the zoo's registry (``shared``); zoo/__init__ imports this module
from meshfold.tools.zoo.models import DecoderLayer, LlamaMLP, RMSNorm, Rotary
from meshfold.tools.zoo.shared import _seeded, _shifted_ce, _small_init, _token_inputs, register


class LinearAttention(nn.Module):
    """Causal linear attention: ``o_t = phi(q_t) . sum_{s <= t} phi(k_s) v_s^T``, the running sum
    written as a ``cumsum`` along the sequence of the outer products, normalised by the running
    sum of the keys (``phi``: a softmax over the head dim, positive).

    ``gated``: the memory decays by ``g_t`` in (0, 1) per head and token (``S_t = g_t S_{t-1} + k_t
    v_t^T``), written in closed form with running sums only: with ``A_t = sum_{r <= t} log g_r``,
    ``S_t = exp(A_t) sum_{s <= t} exp(-A_s) k_s v_s^T`` (and the normaliser likewise)."""

    def __init__(self, hidden: int, n_heads: int, gated: bool = False) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, hidden // n_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, n_heads) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = q.softmax(-1), k.softmax(-1)
        if self.gate is not None:
            # NOTE: gates near 1 (a bias of 4): the memory fades over tens of tokens
            decay = F.logsigmoid(self.gate(x) + 4.0).transpose(1, 2).cumsum(-1).unsqueeze(-1)
            q, k = q * decay.exp(), k * (-decay).exp()
        state = torch.einsum("bhtd,bhte->bhtde", k, v).cumsum(2)
        norm = torch.einsum("bhtd,bhtd->bht", q, k.cumsum(2)).unsqueeze(-1)
        y = torch.einsum("bhtd,bhtde->bhte", q, state) / norm
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h))


class LinearLayer(nn.Module):
    """Pre-RMSNorm layer: linear attention, then a SwiGLU MLP."""

    def __init__(self, hidden: int, intermediate: int, gated: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.linear_attn = LinearAttention(hidden, n_heads=2, gated=gated)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = LlamaMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.linear_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridTiny(nn.Module):
    """A linear-attention layer, then a llama-tiny softmax-attention layer; untied LM head."""

    def __init__(self, vocab: int = 256, hidden: int = 64, intermediate: int = 128, gated: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.rotary = Rotary(hidden // 4)
        self.linear = LinearLayer(hidden, intermediate, gated)
        self.softmax = DecoderLayer(hidden, intermediate)
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.apply(_small_init)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(input_ids.size(1))
        x = self.softmax(self.linear(self.embed_tokens(input_ids)), cos, sin, [])
        return _shifted_ce(self.lm_head(self.norm(x)), labels)


@register("hybrid-tiny")
def _hybrid_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A linear-attention layer and a softmax-attention layer (vocab 256, hidden 64) on ``(input_ids, labels)``."""
    return _seeded(HybridTiny), _token_inputs(256)


@register("hybrid-gated-tiny")
def _hybrid_gated_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``hybrid-tiny`` whose linear attention's memory decays by a gate per head and token."""
    return _seeded(lambda: HybridTiny(gated=True)), _token_inputs(256)


class ChunkedDeltaRule(nn.Module):
    """One head of a gated delta rule run chunk by chunk, as HF's fallback for Qwen3-Next writes it: per
    chunk the new values less what the state already predicts, the output read from the state plus
    the chunk's own causal attention, then the state decayed by a gate and updated (a Python loop over
    chunks; ``meshfold.rewrites.fold_scan`` captures it as one recurrence). Value dim 6: no mesh axis of 4
    splits the state's columns."""

    def __init__(self, hidden: int, k: int = 8, v: int = 6, chunk: int = 4) -> None:
        super().__init__()
        self.k, self.v, self.chunk = k, v, chunk
        self.proj = nn.Linear(hidden, 2 * k + v + 2, bias=False)
        self.out = nn.Linear(v, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        n, c = t // self.chunk, self.chunk
        q, key, val, beta, gate = self.proj(x).split([self.k, self.k, self.v, 1, 1], -1)
        q, key, val = (y.reshape(b, n, c, -1) for y in (q.softmax(-1), key.softmax(-1), val))
        k_beta = key * beta.sigmoid().reshape(b, n, c, 1)
        decay = torch.sigmoid(gate.reshape(b, n, c).mean(-1) + 2.0)[..., None, None]
        attn = (q @ key.transpose(-1, -2)).tril()
        state = torch.zeros(b, self.k, self.v, dtype=x.dtype)
        out = torch.zeros(b, n, c, self.v, dtype=x.dtype)
        for i in range(n):
            v_new = val[:, i] - k_beta[:, i] @ state
            out[:, i] = q[:, i] @ state + attn[:, i] @ v_new
            state = state * decay[:, i] + key[:, i].transpose(-1, -2) @ v_new
        return self.out(out.reshape(b, t, self.v))


class DeltaTiny(nn.Module):
    """Embedding, a chunked gated delta rule with a residual, an RMSNorm and an untied LM head."""

    def __init__(self, vocab: int = 256, hidden: int = 32) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.delta = ChunkedDeltaRule(hidden)
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.apply(_small_init)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return _shifted_ce(self.lm_head(self.norm(x + self.delta(x))), labels)


@register("delta-tiny")
def _delta_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A chunked gated delta rule (4-token chunks, one head, key dim 8, value dim 6) on ``(input_ids, labels)``."""
    return _seeded(DeltaTiny), _token_inputs(256)
