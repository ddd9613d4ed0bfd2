"""The Inductor backend computes low-precision code as the eager model does: a fused kernel rounds
each bf16 intermediate where the eager op rounds it (``backends/inductor.py``'s ``INDUCTOR_CONFIG``).
Without that, ``silu(a) * b`` in bf16 skips the rounding of ``silu(a)``, and a top-k router
downstream can pick another expert than the single-device model does."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from meshfold.backends.inductor import Compiled


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    # NOTE: torchtitan's grouped experts' form: bf16 matmuls, a fused gate, the result back in fp32
    h = F.silu(x @ w1) * (x @ w3)
    return (h @ w2).float()


def test_a_bf16_program_compiled_by_inductor_rounds_as_the_eager_ops_do() -> None:
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(64, 64, generator=gen).bfloat16() for _ in range(4)]
    program = Compiled(fx.symbolic_trace(_swiglu), "rank 0's forward program")
    got = program(*args)
    want = _swiglu(*args)
    assert program.calls == 1 and program.seconds > 0
    # NOTE: bit for bit: without the eager roundings about a quarter of the entries move by bf16 ulps
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} entries differ"
