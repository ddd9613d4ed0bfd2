"""Mixture-of-experts ops: the routed experts of one MoE layer as ONE op, forward and backward.

``meshfold.moe_experts(hidden, top_k_index, top_k_weights, w_gate_up, w_down, act)`` is what every
MoE layer computes once its router has chosen: each token ``t`` goes to experts
``top_k_index[t, :]``; expert ``e`` computes ``act(x Wg_e^T) * (x Wu_e^T)`` then ``· Wd_e^T`` (a
gated MLP; ``w_gate_up[e]`` stacks ``[Wg_e; Wu_e]``), and the token's output is the sum of its
experts' outputs weighted by ``top_k_weights[t, :]``. Dispatch (grouping tokens by expert), the
grouped GEMMs and the combine are inside the op, so the rest of the graph only sees tokens in and
tokens out, and a layout can say "experts sharded" (``w_* S(0)``) without naming a ragged buffer.

Dropless: every routed token is computed. The backward is its own op
(``meshfold.moe_experts_backward``), so joint graphs carry both halves. ``experts(...)`` is the
autograd-aware call for model code (the marker API: MoE code meshfold does not recognize can call it
to be folded). ``experts_range`` computes only experts ``[lo, lo + n)`` — one rank's share when the
expert weights are sharded; every other token row is zero, so shares sum to the whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _act_backward(act: str, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    aten = torch.ops.aten
    if act == "silu":
        out = aten.silu_backward(grad, x)
    elif act in ("gelu", "gelu_tanh"):
        out = aten.gelu_backward(grad, x, approximate="tanh" if act == "gelu_tanh" else "none")
    else:
        out = aten.threshold_backward(grad, x, 0)
    assert isinstance(out, torch.Tensor)
    return out


def _check(hidden: torch.Tensor, idx: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, act: str) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"moe_experts: unknown activation {act!r}; known: {', '.join(ACTIVATIONS)}")
    if hidden.dim() != 2 or idx.dim() != 2 or idx.size(0) != hidden.size(0):
        raise ValueError(f"moe_experts: hidden must be [T, H] and top_k_index [T, k]; got {hidden.shape}, {idx.shape}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3 or w_gate_up.size(1) != 2 * w_down.size(2):
        raise ValueError(
            f"moe_experts: w_gate_up must be [E, 2I, H] and w_down [E, H, I]; got {w_gate_up.shape}, {w_down.shape}"
        )


def experts_range(
    lo: int,
    hidden: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """The experts' output for experts ``[lo, lo + len(w_down))`` (the weights given), zero elsewhere."""
    out = torch.zeros_like(hidden)
    inter = w_down.size(2)
    fn = ACTIVATIONS[act]
    for e in range(w_down.size(0)):
        tok, slot = torch.where(idx == lo + e)
        if tok.numel() == 0:
            continue
        gu = hidden[tok] @ w_gate_up[e].t()
        z = fn(gu[:, :inter]) * gu[:, inter:]
        o = z @ w_down[e].t()
        out.index_add_(0, tok, (o * weights[tok, slot, None]).to(out.dtype))
    return out


def experts_range_backward(
    lo: int,
    grad: torch.Tensor,
    hidden: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`experts_range` w.r.t. hidden, weights, w_gate_up, w_down (the given experts')."""
    d_hidden = torch.zeros_like(hidden)
    d_weights = torch.zeros_like(weights)
    d_gate_up = torch.zeros_like(w_gate_up)
    d_down = torch.zeros_like(w_down)
    inter = w_down.size(2)
    fn = ACTIVATIONS[act]
    for e in range(w_down.size(0)):
        tok, slot = torch.where(idx == lo + e)
        if tok.numel() == 0:
            continue
        x = hidden[tok]
        gu = x @ w_gate_up[e].t()
        g, u = gu[:, :inter], gu[:, inter:]
        a = fn(g)
        z = a * u
        o = z @ w_down[e].t()
        dy = grad[tok]
        d_weights[tok, slot] = (dy * o).sum(-1).to(d_weights.dtype)
        do = dy * weights[tok, slot, None].to(dy.dtype)
        d_down[e] = do.t() @ z
        dz = do @ w_down[e]
        dgu = torch.cat((_act_backward(act, dz * u, g), dz * a), dim=-1)
        d_gate_up[e] = dgu.t() @ x
        d_hidden.index_add_(0, tok, dgu @ w_gate_up[e])
    return d_hidden, d_weights, d_gate_up, d_down


@torch.library.custom_op("meshfold::moe_experts", mutates_args=())
def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """Routed experts of one MoE layer (see the module docstring); dropless."""
    _check(hidden, top_k_index, w_gate_up, w_down, act)
    return experts_range(0, hidden, top_k_index, top_k_weights, w_gate_up, w_down, act)


@moe_experts.register_fake
def _moe_experts_fake(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
) -> torch.Tensor:
    _check(hidden, top_k_index, w_gate_up, w_down, act)
    return torch.empty_like(hidden)


@torch.library.custom_op("meshfold::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``moe_experts`` w.r.t. hidden, top_k_weights, w_gate_up and w_down."""
    return experts_range_backward(0, grad, hidden, top_k_index, top_k_weights, w_gate_up, w_down, act)


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(hidden),
        torch.empty_like(top_k_weights),
        torch.empty_like(w_gate_up),
        torch.empty_like(w_down),
    )


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    *tensors, act = inputs
    ctx.save_for_backward(*[t for t in tensors if isinstance(t, torch.Tensor)])
    ctx.act = act  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    hidden, idx, weights, w_gate_up, w_down = ctx.saved_tensors  # type: ignore[attr-defined]
    act = ctx.act  # type: ignore[attr-defined]
    dh, dw, dgu, dd = torch.ops.meshfold.moe_experts_backward(grad, hidden, idx, weights, w_gate_up, w_down, act)
    return dh, None, dw, dgu, dd, None


moe_experts.register_autograd(_backward, setup_context=_setup)

EXPERTS = torch.ops.meshfold.moe_experts.default
EXPERTS_BACKWARD = torch.ops.meshfold.moe_experts_backward.default


def experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str = "silu",
) -> torch.Tensor:
    """Call the routed experts from model code: ``hidden [T, H]``, ``top_k_index``/``top_k_weights``
    ``[T, k]``, ``w_gate_up [E, 2I, H]``, ``w_down [E, H, I]``. Differentiable; meshfold can shard
    the experts of every layer written this way."""
    return torch.ops.meshfold.moe_experts(hidden, top_k_index, top_k_weights, w_gate_up, w_down, act)  # type: ignore[no-any-return]
