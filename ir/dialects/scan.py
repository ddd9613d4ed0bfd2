"""``meshfold.affine_scan``: a linear recurrence along one dim, as one op.

``affine_scan(m [*, n, k, k], b [*, n, k, v], s0 [*, k, v]) -> h [*, n, k, v]`` gives the state
before each of ``n`` steps: ``h_0 = s0``, ``h_{i+1} = m_i @ h_i + b_i``. A loop over chunks that
carries such a state (the gated delta rule of DeltaNet and Qwen3-Next run chunk by chunk, a scalar
decay's linear attention, a state-space scan) is captured as this op (``meshfold.rewrites.fold_scan``), so
the sharding rules see the recurrence whole: the steps may be split over ranks, each rank then needs
only what the ranks before it leave behind, and that is a composite ``(m, b)`` pair of the state's
size whatever the sequence (``backends/context_parallel/split_scans.py``; LASP-2's one all-gather of memory states,
with a
matrix in place of a scalar decay).

``diagonal=True``: ``m [*, n, k, v]`` scales the state element by element, ``h_{i+1} = m_i * h_i +
b_i`` (a selective state-space scan: Mamba's per-channel decay of each state entry).

``affine_scan_backward(m, h, grad) -> (dm, db, ds0)``: the gradient runs the same recurrence the
other way, ``g_i = grad_i + m_iᵀ g_{i+1}`` (``g_n = 0``), then ``dm_i = g_{i+1} h_iᵀ``,
``db_i = g_{i+1}``, ``ds0 = g_0`` (diagonal: ``m_i * g_{i+1}`` and ``g_{i+1} * h_i``).
"""

from __future__ import annotations

import torch


def _check(m: torch.Tensor, b: torch.Tensor, s0: torch.Tensor, diagonal: bool) -> None:
    lead, n, k, v = b.shape[:-3], b.shape[-3], b.shape[-2], b.shape[-1]
    shape = "m [*, n, k, v]" if diagonal else "m [*, n, k, k]"
    if b.dim() < 3 or m.shape != (*lead, n, k, v if diagonal else k) or s0.shape != (*lead, k, v):
        raise ValueError(
            f"affine_scan takes {shape}, b [*, n, k, v] and s0 [*, k, v]; got m {list(m.shape)}, "
            f"b {list(b.shape)}, s0 {list(s0.shape)}"
        )


def step(m: torch.Tensor, s: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """``m @ s`` (``m * s`` when diagonal)."""
    return m * s if diagonal else m @ s


def scan(m: torch.Tensor, b: torch.Tensor, s: torch.Tensor, diagonal: bool = False) -> torch.Tensor:
    """States before each step, from ``s`` (the recurrence of the module docstring, step by step)."""
    out = []
    for i in range(m.shape[-3]):
        out.append(s)
        s = step(m[..., i, :, :], s, diagonal) + b[..., i, :, :]
    return torch.stack(out, -3) if out else b.new_empty(b.shape)


def composite(
    m: torch.Tensor, b: torch.Tensor | None, diagonal: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(p, c)`` with ``state after all steps = p @ state before + c``: the steps as one (``c`` None
    when ``b`` is)."""
    k = m.shape[-1]
    eye = torch.eye(k, dtype=m.dtype, device=m.device).expand(*m.shape[:-3], k, k)
    p = torch.ones_like(m[..., 0, :, :]) if diagonal else eye
    c = None if b is None else b.new_zeros(*b.shape[:-3], *b.shape[-2:])
    for i in range(m.shape[-3]):
        mi = m[..., i, :, :]
        p = step(mi, p, diagonal)
        c = None if c is None or b is None else step(mi, c, diagonal) + b[..., i, :, :]
    return p, c


def scan_back(
    m: torch.Tensor, h: torch.Tensor, grad: torch.Tensor, g_end: torch.Tensor, diagonal: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dm, db, g_0)`` of steps ``m`` whose states were ``h``, ``g_end`` the gradient of the state
    after the last step (zero for the last rank's)."""
    dm, db = torch.empty_like(m), torch.empty_like(h)
    g = g_end
    for i in reversed(range(m.shape[-3])):
        db[..., i, :, :] = g
        mi, hi = m[..., i, :, :], h[..., i, :, :]
        dm[..., i, :, :] = g * hi if diagonal else g @ hi.mT
        g = grad[..., i, :, :] + step(mi if diagonal else mi.mT, g, diagonal)
    return dm, db, g


@torch.library.custom_op("meshfold::affine_scan", mutates_args=())
def affine_scan(m: torch.Tensor, b: torch.Tensor, s0: torch.Tensor, diagonal: bool = False) -> torch.Tensor:
    """States before each step of ``h_{i+1} = m_i @ h_i + b_i`` from ``h_0 = s0`` (module docstring)."""
    _check(m, b, s0, diagonal)
    # NOTE: contiguous, as the fake below says: a compiler plans the buffers after it by those strides
    return scan(m, b, s0, diagonal).contiguous()


@affine_scan.register_fake
def _affine_scan_fake(m: torch.Tensor, b: torch.Tensor, s0: torch.Tensor, diagonal: bool = False) -> torch.Tensor:
    _check(m, b, s0, diagonal)
    return b.new_empty(b.shape)


@torch.library.custom_op("meshfold::affine_scan_backward", mutates_args=())
def affine_scan_backward(
    m: torch.Tensor, h: torch.Tensor, grad: torch.Tensor, diagonal: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``affine_scan`` w.r.t. ``m``, ``b`` and ``s0`` (module docstring)."""
    dm, db, ds0 = scan_back(m, h, grad, torch.zeros_like(h[..., 0, :, :]), diagonal)
    return dm.contiguous(), db.contiguous(), ds0.contiguous()


@affine_scan_backward.register_fake
def _affine_scan_backward_fake(
    m: torch.Tensor, h: torch.Tensor, grad: torch.Tensor, diagonal: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return m.new_empty(m.shape), h.new_empty(h.shape), h.new_empty(*h.shape[:-3], *h.shape[-2:])


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    m = inputs[0]
    assert isinstance(m, torch.Tensor)
    ctx.save_for_backward(m, output)
    ctx.diagonal = bool(inputs[3]) if len(inputs) > 3 else False  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    m, h = ctx.saved_tensors  # type: ignore[attr-defined]
    # NOTE: ``diagonal`` by keyword and only when set, so a captured left-multiplied scan reads as before
    extra = {"diagonal": True} if ctx.diagonal else {}  # type: ignore[attr-defined]
    dm, db, ds0 = torch.ops.meshfold.affine_scan_backward(m, h, grad, **extra)
    return dm, db, ds0, None


affine_scan.register_autograd(_backward, setup_context=_setup)

SCAN = torch.ops.meshfold.affine_scan.default
SCAN_BACKWARD = torch.ops.meshfold.affine_scan_backward.default
