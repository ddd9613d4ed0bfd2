"""Roofline time of one kernel: ``max(flops / (peak * eff_flops), bytes / (bw * eff_bw)) + launch``.

Both efficiencies are smooth saturating curves of the kernel's size, and each is exactly a fixed
time overhead in disguise:

* ``eff_flops(F, K) = gemm_max * K / (K + k_half) * F / (F + F_fill)`` with
  ``F_fill = peak * gemm_max * fill_s``. The last factor turns ``F / (peak * eff)`` into
  ``F / (peak * gemm_max) + fill_s``: every kernel pays its pipeline fill/drain and its last
  partial wave once, so small GEMMs are inefficient and large ones saturate at ``gemm_max``
  (~0.78 on H100, the power-capped sustained matmul rate). The ``K`` factor is the per-tile
  prologue/epilogue amortised over the reduction loop: shallow reductions waste more of each tile.
* ``eff_bw(B) = mem_max * B / (B + B_ramp)`` with ``B_ramp = bw * mem_max * ramp_s``: a streaming
  kernel needs ``ramp_s`` of memory latency before it runs at ``mem_max`` of HBM bandwidth.

The launch floor is the device-side gap between dependent kernels. All inputs are per device;
nothing here knows about parallelism.
"""

from __future__ import annotations

import functools

from meshfold.target.hardware import DTYPE_BYTES, Device


def flops_efficiency(
    dev: Device, flops: float, k: float | None, dtype: str = "bf16", *, attention: str = "", mn: float | None = None
) -> float:
    """Fraction of dense peak a kernel of ``flops`` with reduction depth ``k`` reaches.

    ``attention`` in {"", "fwd", "bwd"} selects the fused-attention ceiling instead of the GEMM one;
    ``k=None`` skips the reduction-depth factor (the attention ceilings are measured at their
    usual head dim and already include it)."""
    e = dev.eff
    ceiling = {"": e.gemm_max, "fwd": e.attn_fwd_max, "bwd": e.attn_bwd_max}[attention]
    fill_flops = dev.peak_flops(dtype) * ceiling * e.gemm_fill_s
    depth = 1.0 if k is None else k / (k + e.gemm_k_half)
    waves = 1.0 if mn is None else mn / (mn + e.gemm_mn_half)
    return ceiling * depth * waves * (flops / (flops + fill_flops))


def bandwidth_efficiency(dev: Device, nbytes: float) -> float:
    """Fraction of HBM bandwidth a streaming kernel moving ``nbytes`` reaches."""
    e = dev.eff
    ramp = dev.hbm_bw * e.mem_max * e.mem_ramp_s
    return e.mem_max * nbytes / (nbytes + ramp)


def roofline(
    dev: Device,
    flops: float,
    nbytes: float,
    k: float | None,
    dtype: str = "bf16",
    *,
    attention: str = "",
    mn: float | None = None,
) -> float:
    """Seconds for one kernel: the slower of its math and its memory traffic, plus the launch gap."""
    t_math = 0.0
    if flops > 0:  # NOTE: a device without fill time (the host CPU) has no efficiency at 0 FLOPs
        t_math = flops / (dev.peak_flops(dtype) * flops_efficiency(dev, flops, k, dtype, attention=attention, mn=mn))
    t_mem = nbytes / (dev.hbm_bw * bandwidth_efficiency(dev, nbytes)) if nbytes > 0 else 0.0
    return max(t_math, t_mem) + dev.eff.launch_s


@functools.lru_cache(maxsize=65536)
def gemm_time(dev: Device, m: float, n: float, k: float, dtype: str = "bf16", *, extra_bytes: float = 0.0) -> float:
    """Seconds for ``(m x k) @ (k x n)`` in ``dtype``; ``extra_bytes`` adds epilogue traffic (bias,
    fp32 gradient accumulation into ``main_grad``)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    size = DTYPE_BYTES[dtype]
    return roofline(dev, 2.0 * m * n * k, (m * k + k * n + m * n) * size + extra_bytes, k, dtype, mn=m * n)


@functools.lru_cache(maxsize=16384)
def grouped_gemm_time(dev: Device, groups: int, m: float, n: float, k: float, dtype: str = "bf16") -> float:
    """Seconds for one grouped GEMM of ``groups`` independent ``(m x k) @ (k x n)`` problems (MoE
    experts): one launch and one fill; each group's rows are padded to the 128-row tile, which
    costs ``m / (m + 64)`` on average."""
    if groups <= 0 or m <= 0:
        return 0.0
    size = DTYPE_BYTES[dtype]
    flops = 2.0 * groups * m * n * k
    pad = m / (m + 64.0)
    t_math = flops / (dev.peak_flops(dtype) * flops_efficiency(dev, flops, k, dtype, mn=groups * m * n) * pad)
    nbytes = groups * (m * k + k * n + m * n) * size
    t_mem = nbytes / (dev.hbm_bw * bandwidth_efficiency(dev, nbytes))
    return max(t_math, t_mem) + dev.eff.launch_s


def memory_time(dev: Device, nbytes: float, kernels: int = 1) -> float:
    """Seconds for ``kernels`` memory-bound kernels that together move ``nbytes``."""
    if nbytes <= 0:
        return 0.0
    per = nbytes / kernels
    return kernels * (per / (dev.hbm_bw * bandwidth_efficiency(dev, per)) + dev.eff.launch_s)


def attention_flops(tokens: float, ctx: float, heads: float, qk_dim: int, v_dim: int, causal: bool) -> float:
    """Executed forward FLOPs of fused attention for ``tokens`` queries over ``ctx`` keys: a causal
    mask skips the upper triangle (half the work for a square block)."""
    full = 2.0 * tokens * ctx * heads * (qk_dim + v_dim)
    return full * 0.5 if causal else full


@functools.lru_cache(maxsize=16384)
def attention_time(
    dev: Device,
    tokens: float,
    ctx: float,
    heads: float,
    qk_dim: int,
    v_dim: int,
    *,
    causal: bool = True,
    backward: bool = False,
    dtype: str = "bf16",
    fused: bool = True,
) -> float:
    """Seconds for attention of ``tokens`` queries over ``ctx`` keys on ``heads`` local heads.

    ``fused``: one flash-attention kernel; its backward runs five matmuls to the forward's two (it
    recomputes the scores), i.e. 2.5x the FLOPs. Unfused: two batched GEMMs (doubled in the
    backward) plus a softmax that writes the ``tokens x ctx`` score matrix per head to HBM (and
    reads it back in the backward); the causal mask saves no work there."""
    if tokens <= 0 or heads <= 0:
        return 0.0
    size = DTYPE_BYTES[dtype]
    if not fused:
        mult = 2 if backward else 1
        qk = gemm_time(dev, heads * tokens, ctx, qk_dim, dtype) * mult
        pv = gemm_time(dev, heads * tokens, v_dim, ctx, dtype) * mult
        scores = tokens * ctx * heads * size
        return qk + pv + memory_time(dev, scores * (3 if backward else 2))
    flops = attention_flops(tokens, ctx, heads, qk_dim, v_dim, causal) * (2.5 if backward else 1.0)
    nbytes = (tokens * heads * (qk_dim + v_dim) * 2 + ctx * heads * (qk_dim + v_dim)) * size * (2 if backward else 1)
    return roofline(dev, flops, nbytes, None, dtype, attention="bwd" if backward else "fwd")
