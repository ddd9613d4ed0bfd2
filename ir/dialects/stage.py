"""Pipeline stage boundaries in a captured program: ``meshfold.stage_in`` and its gradient.

Before a model is captured for pipeline parallelism, every layer of its layer stack reads its
input (the hidden states) through ``stage_in``: the identity, whose backward is ``stage_in_grad``,
the identity again. In the joint graph the pair marks, at every layer, the one value that enters
the layer from the one before it and the gradient that leaves it: a stage starting at layer ``k``
receives ``stage_in``'s operand from the stage before it, and sends that stage ``stage_in_grad``'s
result (``meshfold.pp.pipelined`` splits the program there). Backends run both as the identity, so a
mark no stage starts at costs nothing.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.library.custom_op("meshfold::stage_in", mutates_args=())
def stage_in(x: torch.Tensor) -> torch.Tensor:
    """The hidden states entering a layer (the identity; see the module doc)."""
    return x.clone()


@stage_in.register_fake
def _(x):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)


@torch.library.custom_op("meshfold::stage_in_grad", mutates_args=())
def stage_in_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient leaving a layer for the one before it (the identity; see the module doc)."""
    return grad.clone()


@stage_in_grad.register_fake
def _(grad):  # type: ignore[no-untyped-def]
    return torch.empty_like(grad)


def _backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.meshfold.stage_in_grad(grad)
    return out


stage_in.register_autograd(_backward)

STAGE_IN = torch.ops.meshfold.stage_in.default
STAGE_IN_GRAD = torch.ops.meshfold.stage_in_grad.default
MARKS = (STAGE_IN, STAGE_IN_GRAD)
