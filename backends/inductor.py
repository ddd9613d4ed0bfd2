"""Each rank's programs compiled by TorchInductor: C++ kernels on CPU, Triton on CUDA.

``backends/eager.py`` lowers a rank's forward and backward to ``fx.GraphModule``s of ATen ops and
``torch.ops._c10d_functional`` collectives; this backend hands each module to Inductor
(``torch._inductor.compile_fx.compile_fx``) on its first call, with fake copies of that call's
tensors (their shapes, strides and dtypes: a module is always called alike, ``programs.Program``
keeps one per signature). Inductor fuses the pointwise and reduction ops between the collectives
and keeps each collective's start and wait where the ``overlap`` pass put them: its reorderings for
locality and peak memory, on by default, would pull every wait up to its collective's start (on
llama-tiny under fsdp+tp, the matrix products in flight beside collectives fall from 8 to 2 in the
forward and from 56 to 0 in the backward), so they are off while it compiles our programs; the
compiled programs then have the eager order's windows exactly (``tests/dist/test_inductor.py``). Fused
kernels round bf16 and fp16 intermediates where the eager ops round them (``INDUCTOR_CONFIG``).
The MoE token exchange runs as one opaque custom op (``meshfold::moe_exchange``) whose fake kernel
gives its result's shape, since the tokens each expert gets are known only while it runs.

Compiled code is cached on disk by Inductor (``TORCHINDUCTOR_CACHE_DIR``, by default under the
system's temporary directory), so a second run of the same program loads its kernels instead of
compiling them again.

What the compiled modules do not keep: a failing collective is reported for the whole program
(``CollectiveError`` naming the program and rank), not for the one collective, since the wait
inside compiled code cannot name itself. Random ops (dropout) run as the ordered custom op
``meshfold::random_call``: Inductor calls each draw from meshfold's generator as it is, in the eager
program's order, so the masks stay the single-device model's. Programs with ops Inductor cannot
compile (activations offloaded to host files, ring attention and the other lowerings that call
process groups directly) are refused when lowered, naming the op and pointing at
``backend="eager"``. A pipeline's stage programs compile alike (``meshfold.pp.pipelined``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from meshfold.backends.eager import Lowered
from meshfold.backends.traceable import plain
from meshfold.backends.watch import CollectiveError

INDUCTOR_CONFIG: dict[str, bool] = {
    # NOTE: Inductor's reorderings for locality and peak memory move each wait up to its
    # collective's start; without them it keeps the order the overlap pass chose
    "reorder_for_locality": False,
    "reorder_for_peak_memory": False,
    # NOTE: a fused kernel rounds a bf16/fp16 intermediate to its dtype wherever the eager op would, so
    # a program computes what the model does; without it, silu(a) * b in bf16 skips the rounding of
    # silu(a) and a quarter of a SwiGLU's outputs move by an ulp (tests/unit/test_inductor_numerics.py).
    # Programs in fp32 compile the same either way.
    "emulate_precision_casts": True,
}
"""The Inductor settings every program of ours compiles under."""


@dataclass
class Compiled:
    """One module compiled by Inductor on its first call (``what`` names it in errors)."""

    module: fx.GraphModule
    what: str
    fn: Callable[..., Any] | None = None
    seconds: float = 0.0
    """Wall time of the compile (0 until the first call)."""
    calls: int = field(default=0)

    def __call__(self, *args: Any) -> Any:
        if self.fn is None:
            self.fn = self._compile(args)
        self.calls += 1
        try:
            return self.fn(*args)
        except RuntimeError as e:
            if isinstance(e, CollectiveError) or not _collective_failure(e):
                raise
            raise CollectiveError(
                f"a collective of {self.what} (compiled by Inductor) did not complete: {str(e).splitlines()[0]}. "
                "A rank of its group is stuck or has exited; backend='eager' names the collective"
            ) from e

    def _compile(self, args: Sequence[Any]) -> Callable[..., Any]:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake = FakeTensorMode(allow_non_fake_inputs=False)
        examples = [fake.from_tensor(a.detach()) if isinstance(a, torch.Tensor) else a for a in args]
        start = time.perf_counter()
        with torch.no_grad(), inductor_config.patch(**INDUCTOR_CONFIG):
            fn = compile_fx(self.module, examples)
        self.seconds = time.perf_counter() - start
        return fn


def _collective_failure(e: RuntimeError) -> bool:
    text = str(e)
    return any(word in text for word in ("Gloo", "gloo", "NCCL", "Connection", "timed out", "Timeout"))


_CANNOT = "backend='inductor' cannot compile"
_ADVICE = "Use backend='eager' for this model and plan"


def compiled(low: Lowered, rank: str) -> Lowered:
    """``low`` with its modules compiled by Inductor on first call (``rank`` names them in errors).
    Raises ``PassError`` now, before anything runs, where a module calls what Inductor cannot compile."""

    def one(module: fx.GraphModule | None, what: str) -> Any:
        if module is None:
            return None
        return Compiled(plain(module, _CANNOT, _ADVICE, random_op=True), f"{rank}'s {what} program")

    return replace(
        low,
        forward=one(low.forward, "forward"),
        backward=one(low.backward, "backward"),
        weights=one(low.weights, "weight-gradient"),
    )
