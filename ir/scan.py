"""``meshfold.affine_scan``: a linear recurrence along one dim, as one op.

``affine_scan(m [*, n, k, k], b [*, n, k, v], s0 [*, k, v]) -> h [*, n, k, v]`` gives the state
before each of ``n`` steps: ``h_0 = s0``, ``h_{i+1} = m_i @ h_i + b_i``. A loop over chunks that
carries such a state (the gated delta rule of DeltaNet and Qwen3-Next run chunk by chunk, a scalar
decay's linear attention, a state-space scan) is captured as this op (``meshfold.fold_scan``), so
the sharding rules see the recurrence whole: the steps may be split over ranks, each rank then needs
only what the ranks before it leave behind, and that is a composite ``(m, b)`` pair of the state's
size whatever the sequence (``backends/scan.py``; LASP-2's one all-gather of memory states, with a
matrix in place of a scalar decay).

``affine_scan_backward(m, h, grad) -> (dm, db, ds0)``: the gradient runs the same recurrence the
other way, ``g_i = grad_i + m_iᵀ g_{i+1}`` (``g_n = 0``), then ``dm_i = g_{i+1} h_iᵀ``,
``db_i = g_{i+1}``, ``ds0 = g_0``.
"""

from __future__ import annotations

import torch


def _check(m: torch.Tensor, b: torch.Tensor, s0: torch.Tensor) -> None:
    lead, n, k, v = b.shape[:-3], b.shape[-3], b.shape[-2], b.shape[-1]
    if b.dim() < 3 or m.shape != (*lead, n, k, k) or s0.shape != (*lead, k, v):
        raise ValueError(
            f"affine_scan takes m [*, n, k, k], b [*, n, k, v] and s0 [*, k, v]; got m {list(m.shape)}, "
            f"b {list(b.shape)}, s0 {list(s0.shape)}"
        )


def scan(m: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """States before each step, from ``s`` (the recurrence of the module docstring, step by step)."""
    out = []
    for i in range(m.shape[-3]):
        out.append(s)
        s = m[..., i, :, :] @ s + b[..., i, :, :]
    return torch.stack(out, -3) if out else b.new_empty(b.shape)


def composite(m: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, c)`` with ``state after all steps = p @ state before + c``: the steps as one."""
    k = m.shape[-1]
    p = torch.eye(k, dtype=m.dtype, device=m.device).expand(*m.shape[:-3], k, k)
    c = torch.zeros_like(b[..., 0, :, :]) if b.shape[-3] else b.new_zeros(*b.shape[:-3], *b.shape[-2:])
    for i in range(m.shape[-3]):
        mi = m[..., i, :, :]
        p, c = mi @ p, mi @ c + b[..., i, :, :]
    return p, c


def scan_back(
    m: torch.Tensor, h: torch.Tensor, grad: torch.Tensor, g_end: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dm, db, g_0)`` of steps ``m`` whose states were ``h``, ``g_end`` the gradient of the state
    after the last step (zero for the last rank's)."""
    dm, db = torch.empty_like(m), torch.empty_like(h)
    g = g_end
    for i in reversed(range(m.shape[-3])):
        db[..., i, :, :] = g
        dm[..., i, :, :] = g @ h[..., i, :, :].mT
        g = grad[..., i, :, :] + m[..., i, :, :].mT @ g
    return dm, db, g


@torch.library.custom_op("meshfold::affine_scan", mutates_args=())
def affine_scan(m: torch.Tensor, b: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """States before each step of ``h_{i+1} = m_i @ h_i + b_i`` from ``h_0 = s0`` (module docstring)."""
    _check(m, b, s0)
    return scan(m, b, s0)


@affine_scan.register_fake
def _affine_scan_fake(m: torch.Tensor, b: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    _check(m, b, s0)
    return torch.empty_like(b)


@torch.library.custom_op("meshfold::affine_scan_backward", mutates_args=())
def affine_scan_backward(
    m: torch.Tensor, h: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``affine_scan`` w.r.t. ``m``, ``b`` and ``s0`` (module docstring)."""
    return scan_back(m, h, grad, torch.zeros_like(h[..., 0, :, :]))


@affine_scan_backward.register_fake
def _affine_scan_backward_fake(
    m: torch.Tensor, h: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(m), torch.empty_like(h), h.new_empty(*h.shape[:-3], *h.shape[-2:])


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0], output)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    m, h = ctx.saved_tensors  # type: ignore[attr-defined]
    dm, db, ds0 = torch.ops.meshfold.affine_scan_backward(m, h, grad)
    return dm, db, ds0


affine_scan.register_autograd(_backward, setup_context=_setup)

SCAN = torch.ops.meshfold.affine_scan.default
SCAN_BACKWARD = torch.ops.meshfold.affine_scan_backward.default
