"""``meshfold.causal_conv1d``: a short causal convolution along the sequence, one filter per channel.

``causal_conv1d(x [B, C, L], w [C, 1, K], bias [C]) -> y [B, C, L]`` with
``y[:, c, t] = bias[c] + sum_j w[c, 0, j] x[:, c, t - (K - 1) + j]`` (zero before the start): what
``conv1d(x, w, bias, padding=K - 1, groups=C)[..., :L]`` computes, the convolution Mamba and the
gated DeltaNet layers run before their scans (``meshfold.rewrites.fuse_conv`` captures it as this op). Written
as one op, the sequence may stay split: a rank needs only the last ``K - 1`` positions of the rank
before it (``backends/context_parallel/halo.py``); its backward, the first ``K - 1`` gradient positions of the rank
after it.

``causal_conv1d_backward(grad, x, w) -> (dx, dw, dbias)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> None:
    if x.dim() != 3 or w.dim() != 3 or w.shape[:2] != (x.shape[1], 1) or bias.shape != (x.shape[1],):
        raise ValueError(
            f"causal_conv1d takes x [B, C, L], w [C, 1, K] and bias [C]; got x {list(x.shape)}, "
            f"w {list(w.shape)}, bias {list(bias.shape)}"
        )


def conv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The convolution of ``x`` whose ``K - 1`` positions before it are ``before``."""
    return F.conv1d(torch.cat([before, x], -1), w, bias, groups=x.shape[1])


def conv_back(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, before: torch.Tensor, after: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dw, dbias)`` of :func:`conv` for the positions of ``x``; ``after``: the ``K - 1``
    gradient positions that follow ``grad`` (those outputs read the end of ``x`` too)."""
    k = w.shape[-1]
    dx = F.conv1d(torch.cat([grad, after], -1), w.flip(-1), groups=x.shape[1])
    windows = torch.cat([before, x], -1).unfold(-1, k, 1)  # NOTE: [B, C, L, K]
    dw = torch.einsum("bct,bctj->cj", grad, windows).unsqueeze(1)
    return dx, dw, grad.sum((0, 2))


def _zeros(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.new_zeros(*x.shape[:-1], k - 1)


@torch.library.custom_op("meshfold::causal_conv1d", mutates_args=())
def causal_conv1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The causal convolution of the module docstring."""
    _check(x, w, bias)
    # NOTE: contiguous, as the fake below says: a compiler plans the buffers after it by those strides
    return conv(x, w, bias, _zeros(x, w.shape[-1])).contiguous()


@causal_conv1d.register_fake
def _causal_conv1d_fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _check(x, w, bias)
    return x.new_empty(x.shape)


@torch.library.custom_op("meshfold::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``causal_conv1d`` w.r.t. ``x``, ``w`` and ``bias``."""
    k = w.shape[-1]
    dx, dw, db = conv_back(grad, x, w, _zeros(x, k), _zeros(grad, k))
    return dx.contiguous(), dw.contiguous(), db.contiguous()


@causal_conv1d_backward.register_fake
def _causal_conv1d_backward_fake(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), w.new_empty(w.shape), w.new_empty(w.shape[0])


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, w = ctx.saved_tensors  # type: ignore[attr-defined]
    dx, dw, dbias = torch.ops.meshfold.causal_conv1d_backward(grad, x, w)
    return dx, dw, dbias


causal_conv1d.register_autograd(_backward, setup_context=_setup)

CONV = torch.ops.meshfold.causal_conv1d.default
CONV_BACKWARD = torch.ops.meshfold.causal_conv1d_backward.default
