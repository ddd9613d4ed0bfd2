"""Capture passes: the named rewrites of dynamo's forward graph, before the backward is traced.

Capture runs dynamo, then these passes on its fx graph in the order ``Options.capture`` names them
(all of ``DEFAULT_CAPTURE`` unless it says otherwise), then AOTAutograd's joint trace and the lift
into the IR, where the IR passes (``meshfold.passes``) take over. Each pass turns a pattern of
torch-level calls into one of our ops, so the backward is traced through the op's own rule rather
than through the pattern's pieces. ``pass-debug --list-passes`` lists them beside the IR passes;
``--print-after NAME`` and ``--dump-dir`` show the fx graph each one leaves; golden files under
``tests/golden/capture`` pin what each does to a zoo model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from meshfold import ir
from meshfold.passes.base import PassError
from meshfold.rewrites.fold_scan import fold_scans
from meshfold.rewrites.fuse_attention import fuse_attention
from meshfold.rewrites.fuse_conv import fuse_causal_convs
from meshfold.rewrites.moe_lists import fold_expert_lists


@dataclass
class CaptureState:
    """What a capture pass reads besides the graph (the model, the fake mode it is traced in, the
    experts op's options) and what it hands to the lift (parameters it stacked)."""

    model: nn.Module
    fake_mode: FakeTensorMode
    experts: tuple[str, float, str]
    """Dispatcher, capacity factor and drop policy of the experts ops (``moe_layers.op_options``)."""
    stacked: dict[str, str] = field(default_factory=dict)
    """New parameters' model FQNs by graph attribute."""
    stacks: tuple[ir.ParamStack, ...] = ()


@dataclass(frozen=True)
class CapturePass:
    """Base of the capture passes: ``apply`` rewrites ``gm`` in place and returns how many sites it
    rewrote."""

    name: ClassVar[str]

    def apply(self, state: CaptureState, gm: fx.GraphModule) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class FoldExpertLists(CapturePass):
    """Experts written as an ``nn.ModuleList`` of MLPs, in a form meshfold knows, become one
    ``meshfold.moe_experts`` op on stacked parameters (``rewrites.moe_lists``)."""

    name: ClassVar[str] = "fold-expert-lists"

    def apply(self, state: CaptureState, gm: fx.GraphModule) -> int:
        stacked, stacks = fold_expert_lists(gm, state.model, state.fake_mode, state.experts)
        state.stacked |= stacked
        state.stacks += stacks
        return len(stacks)


@dataclass(frozen=True)
class FuseAttention(CapturePass):
    """Attention written out as ``softmax(Q Kᵀ · scale + mask) V`` becomes one
    ``scaled_dot_product_attention`` call (``rewrites.fuse_attention``)."""

    name: ClassVar[str] = "fuse-attention"

    def apply(self, state: CaptureState, gm: fx.GraphModule) -> int:
        return fuse_attention(gm)


@dataclass(frozen=True)
class FuseCausalConvs(CapturePass):
    """A depthwise ``conv1d`` padded on both sides and cut back to the sequence becomes one
    ``meshfold.causal_conv1d`` (``rewrites.fuse_conv``)."""

    name: ClassVar[str] = "fuse-causal-convs"

    def apply(self, state: CaptureState, gm: fx.GraphModule) -> int:
        return fuse_causal_convs(gm)


@dataclass(frozen=True)
class FoldScans(CapturePass):
    """A Python loop over chunks or tokens carrying a state updated linearly becomes one
    ``meshfold.affine_scan`` (``rewrites.fold_scan``)."""

    name: ClassVar[str] = "fold-scans"

    def apply(self, state: CaptureState, gm: fx.GraphModule) -> int:
        return fold_scans(gm)


CAPTURE_PASSES: dict[str, type[CapturePass]] = {
    p.name: p for p in (FoldExpertLists, FuseAttention, FuseCausalConvs, FoldScans)
}
"""Every capture pass by name; a new one is its class and a line here."""
DEFAULT_CAPTURE = ",".join(CAPTURE_PASSES)
"""What ``Options.capture`` None runs: every capture pass, in the order above (the expert lists are
stacked before any other rewrite reads the experts' linears)."""
AfterCapturePass = Callable[[int, CapturePass, str], None]
"""Called after a capture pass with its index, itself and the fx graph it left, as text."""


def capture_pipeline(spec: str | None) -> tuple[CapturePass, ...]:
    """The capture passes ``spec`` names (``"fuse-attention,fold-scans"``; ``""``: none; None: all),
    or ``PassError`` naming an unknown one and listing the others."""
    names = [n.strip() for n in (DEFAULT_CAPTURE if spec is None else spec).split(",") if n.strip()]
    for n in names:
        if n not in CAPTURE_PASSES:
            raise PassError(f"unknown capture pass {n!r}; capture passes: {', '.join(CAPTURE_PASSES)}")
    return tuple(CAPTURE_PASSES[n]() for n in names)


def run_capture_passes(
    passes: tuple[CapturePass, ...],
    state: CaptureState,
    gm: fx.GraphModule,
    after: Callable[[int, CapturePass, fx.GraphModule], None] | None = None,
) -> None:
    """Run ``passes`` on ``gm`` in order, calling ``after(index, pass, gm)`` after each."""
    for i, p in enumerate(passes):
        p.apply(state, gm)
        if after is not None:
            after(i, p, gm)
