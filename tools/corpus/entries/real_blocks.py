"""The model code of the generated corpus entries (``grammar``): the blocks real decoder code is made
of, each written the way such code writes it, and ``GeneratedLM``, which puts together the blocks a
``ModelSpec`` chooses. Ours, not any project's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.tools.zoo.models import RMSNorm

if TYPE_CHECKING:
    from meshfold.tools.corpus.entries.grammar import ModelSpec

VOCAB = 256
DIM = 64
HEADS = 4
HEAD_DIM = DIM // HEADS
MAX_POSITIONS = 32
"""Rows of the position tables (longer than the sequence of 16: the forward slices them)."""
HIDDEN = 128
"""The dense MLPs' inner width."""
EXPERTS = 4
TOP_K = 2
EXPERT_HIDDEN = 64
WINDOW = 8
DROPOUT = 0.1
ROPE_BASE = 10000.0
LOGIT_SCALE = 0.5
EMBED_STD = 0.02


def make_norm(spec: ModelSpec, dim: int) -> nn.Module:
    """The spec's norm over ``dim`` features (a LayerNorm has a bias when the spec has biases)."""
    if spec.norm == "layernorm":
        return nn.LayerNorm(dim, eps=1e-5, bias=spec.bias)
    return RMSNorm(dim)


def rotated_dims(spec: ModelSpec) -> int:
    """How many leading dimensions of each head the rotary encoding turns (an even number)."""
    return int(HEAD_DIM * spec.rotary) // 2 * 2


def inverse_frequencies(dims: int) -> torch.Tensor:
    """The rotation frequency of each pair of the ``dims`` rotated dimensions."""
    return 1.0 / (ROPE_BASE ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims))


class RealRotary(nn.Module):
    """Rotary position tables as real ``cos``/``sin`` buffers of ``[positions, dims]`` (each
    frequency twice, for ``rotate_half``); ``forward(seq)`` slices the first ``seq`` rows."""

    def __init__(self, dims: int, persistent: bool) -> None:
        super().__init__()
        angles = torch.outer(torch.arange(MAX_POSITIONS, dtype=torch.float32), inverse_frequencies(dims))
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=persistent)
        self.register_buffer("sin", angles.sin(), persistent=persistent)

    def forward(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq], self.sin[:seq]


class ComplexRotary(nn.Module):
    """Rotary position table as one complex64 buffer ``freqs_cis`` of ``[positions, dims / 2]``
    (unit phasors); ``forward(seq)`` slices the first ``seq`` rows."""

    def __init__(self, dims: int, persistent: bool) -> None:
        super().__init__()
        angles = torch.outer(torch.arange(MAX_POSITIONS, dtype=torch.float32), inverse_frequencies(dims))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=persistent)

    def forward(self, seq: int) -> torch.Tensor:
        return self.freqs_cis[:seq]


def make_rotary(spec: ModelSpec) -> nn.Module | None:
    """The spec's rotary table module (None under learned positions)."""
    persistent = spec.tables == "persistent"
    if spec.position == "rope":
        return RealRotary(rotated_dims(spec), persistent)
    if spec.position == "complex-rope":
        return ComplexRotary(rotated_dims(spec), persistent)
    return None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[a, b] -> [-b, a]`` over the halves of the last dimension."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_real_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dimensions of ``x`` (``[batch, heads, seq, head_dim]``) by
    position; the rest pass through."""
    dims = cos.shape[-1]
    turned, kept = x[..., :dims], x[..., dims:]
    turned = turned * cos + rotate_half(turned) * sin
    return torch.cat([turned, kept], dim=-1)


def apply_complex_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * freqs_cis.shape[-1]`` dimensions of ``x`` (``[batch, seq, heads,
    head_dim]``) by multiplying adjacent pairs, read as complex numbers, by ``freqs_cis``."""
    dims = 2 * freqs_cis.shape[-1]
    turned, kept = x[..., :dims], x[..., dims:]
    pairs = torch.view_as_complex(turned.float().reshape(*turned.shape[:-1], -1, 2))
    phasors = freqs_cis.view(1, freqs_cis.shape[0], 1, freqs_cis.shape[1])
    turned = torch.view_as_real(pairs * phasors).flatten(3).type_as(x)
    return torch.cat([turned, kept], dim=-1)


def repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    """``[batch, kv_heads, seq, d]`` with each key/value head repeated ``times`` times in place, so
    query head ``h`` reads kv head ``h // times``."""
    if times == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, times, s, d).reshape(b, kv * times, s, d)


def sliding_window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """``[seq, seq]`` bool mask: query ``i`` sees keys ``j`` with ``i - window < j <= i``."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return (j <= i) & (i - j < window)


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections, ``kv_heads`` key/value heads shared by
    the 4 query heads, an optional per-head qk norm, the spec's rotary encoding (from the table
    handed in, or the module's own ``rotary`` when it has one) and full or sliding-window masking."""

    def __init__(self, spec: ModelSpec, own_rotary: bool) -> None:
        super().__init__()
        self.spec = spec
        self.q_proj = nn.Linear(DIM, HEADS * HEAD_DIM, bias=spec.bias)
        self.k_proj = nn.Linear(DIM, spec.kv_heads * HEAD_DIM, bias=spec.bias)
        self.v_proj = nn.Linear(DIM, spec.kv_heads * HEAD_DIM, bias=spec.bias)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=spec.bias)
        self.q_norm = make_norm(spec, HEAD_DIM) if spec.qk_norm else None
        self.k_norm = make_norm(spec, HEAD_DIM) if spec.qk_norm else None
        self.rotary = make_rotary(spec) if own_rotary else None

    def forward(self, x: torch.Tensor, rope: Any = None) -> torch.Tensor:
        b, s, _ = x.shape
        if self.rotary is not None:
            rope = self.rotary(s)
        q = self.q_proj(x).view(b, s, HEADS, HEAD_DIM)
        k = self.k_proj(x).view(b, s, self.spec.kv_heads, HEAD_DIM)
        v = self.v_proj(x).view(b, s, self.spec.kv_heads, HEAD_DIM)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.spec.position == "complex-rope":
            q, k = apply_complex_rope(q, rope), apply_complex_rope(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.spec.position == "rope":
            cos, sin = rope
            q, k = apply_real_rope(q, cos, sin), apply_real_rope(k, cos, sin)
        groups = HEADS // self.spec.kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        if self.spec.window:
            mask = sliding_window_mask(s, self.spec.window, x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


class GeluMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Routed experts: a bias-free router scores the ``EXPERTS`` SwiGLU experts per token, each token
    goes to its top ``TOP_K`` by softmax probability (renormalized over those), and each expert runs
    on the tokens routed to it, its weighted outputs summed back in place (``index_add_``); a
    shared expert, when there is one, runs on every token and is added. ``dispatch`` says how the
    loop finds an expert's tokens (module docstring)."""

    def __init__(self, shared: bool, dispatch: str) -> None:
        super().__init__()
        self.dispatch = dispatch
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU(DIM, EXPERT_HIDDEN, bias=False) for _ in range(EXPERTS))
        self.shared_expert = SwiGLU(DIM, EXPERT_HIDDEN, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(TOP_K, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        out = torch.zeros_like(flat)
        if self.dispatch == "one-hot":
            # NOTE: routed[e, k, t] is 1 where token t's k-th choice is expert e
            routed = F.one_hot(chosen, num_classes=EXPERTS).permute(2, 1, 0)
            for e, expert in enumerate(self.experts):
                slot, rows = torch.where(routed[e])
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        else:
            for e, expert in enumerate(self.experts):
                rows, slot = torch.where(chosen == e)
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.view(b, s, d)


def make_mlp(spec: ModelSpec) -> nn.Module:
    """The spec's feed-forward block."""
    if spec.mlp == "gelu":
        return GeluMLP(DIM, HIDDEN, spec.bias)
    if spec.mlp == "swiglu":
        return SwiGLU(DIM, HIDDEN, spec.bias)
    return MoE(shared=spec.mlp == "moe+shared", dispatch=spec.dispatch)


def make_dropout(spec: ModelSpec) -> nn.Module:
    return nn.Dropout(DROPOUT) if spec.dropout else nn.Identity()


class Block(nn.Module):
    """One decoder layer in the spec's residual form, with dropout (or none) on each branch.
    ``forward(x, rope)`` takes the rotary table the model hands it; a block built with
    ``own_rotary`` (in an ``nn.Sequential``) takes ``x`` alone and reads its attention's own."""

    def __init__(self, spec: ModelSpec, own_rotary: bool = False) -> None:
        super().__init__()
        self.residual = spec.residual
        self.input_norm = make_norm(spec, DIM)
        self.attn = Attention(spec, own_rotary)
        self.mlp_norm = make_norm(spec, DIM) if spec.residual != "parallel-shared" else None
        self.mlp = make_mlp(spec)
        self.attn_dropout = make_dropout(spec)
        self.mlp_dropout = make_dropout(spec)

    def forward(self, x: torch.Tensor, rope: Any = None) -> torch.Tensor:
        if self.residual == "sequential":
            x = x + self.attn_dropout(self.attn(self.input_norm(x), rope))
            return x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))
        if self.residual == "parallel":
            attn = self.attn_dropout(self.attn(self.input_norm(x), rope))
            return x + attn + self.mlp_dropout(self.mlp(self.mlp_norm(x)))
        h = self.input_norm(x)
        return x + self.attn_dropout(self.attn(h, rope)) + self.mlp_dropout(self.mlp(h))


class GeneratedLM(nn.Module):
    """A decoder LM of ``spec``: token (and learned position) embedding, the layer stack in the
    spec's container, a final norm and an LM head (tied or not), scaled by the persistent
    ``logit_scale``. ``forward(input_ids, labels)`` returns the next-token cross entropy, in the
    spec's output form."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        persistent = spec.tables == "persistent"
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        # NOTE: embeddings start small (std 0.02, as HF initializes them): at torch's std 1 a tied head
        # would score each token's own embedding far above the rest (a loss near 30, not ln 256)
        nn.init.normal_(self.embed_tokens.weight, std=EMBED_STD)
        if spec.position == "learned":
            self.embed_positions = nn.Embedding(MAX_POSITIONS, DIM)
            nn.init.normal_(self.embed_positions.weight, std=EMBED_STD)
            self.register_buffer("position_ids", torch.arange(MAX_POSITIONS), persistent=persistent)
        sequential = spec.container == "Sequential"
        # NOTE: an nn.Sequential's layers see one tensor: each attention holds its own table there
        self.rotary = None if sequential else make_rotary(spec)
        blocks = [Block(spec, own_rotary=sequential) for _ in range(spec.layers)]
        if spec.container == "ModuleList":
            self.layers: nn.Module = nn.ModuleList(blocks)
        elif spec.container == "ModuleDict":
            self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        else:
            self.layers = nn.Sequential(*blocks)
        self.norm = make_norm(spec, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=spec.bias)
        if spec.tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("logit_scale", torch.tensor(LOGIT_SCALE))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        seq = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        if self.spec.position == "learned":
            x = x + self.embed_positions(self.position_ids[:seq])
        x = self.run_layers(x, None if self.rotary is None else self.rotary(seq))
        logits = self.lm_head(self.norm(x)) * self.logit_scale
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        if self.spec.output == "tuple":
            return loss, input_ids.numel(), "generated"
        if self.spec.output == "dict":
            return {"loss": loss, "tokens": input_ids.numel(), "tag": "generated"}
        return loss

    def run_layers(self, x: torch.Tensor, rope: Any) -> torch.Tensor:
        """``x`` through the stack (an ``nn.Sequential`` is called whole)."""
        if isinstance(self.layers, nn.Sequential):
            return self.layers(x)  # type: ignore[no-any-return]
        layers: Iterator[nn.Module] = iter(
            self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        )
        for layer in layers:
            x = layer(x, rope)
        return x
