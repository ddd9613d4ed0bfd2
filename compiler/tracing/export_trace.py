"""Dynamo's export trace of a model's forward: the first half of ``meshfold.capture``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch._dynamo.functional_export as dynamo_export
import torch.fx as fx
from torch import nn


def dynamo_trace(model: nn.Module, inputs: Sequence[Any], *, static: bool = False) -> fx.GraphModule:
    """``model(*inputs)`` traced by dynamo for export, on the fake ``inputs``. ``static``: no input has
    a symbolic size (see ``_no_constraint_check``)."""
    # NOTE: dynamo refuses nn.LSTM/GRU/RNN unless asked; their ATen decompositions trace fine.
    with torch._dynamo.config.patch(allow_rnn=True), _no_constraint_check() if static else contextlib.nullcontext():
        return dynamo_export._dynamo_graph_capture_for_export(model)(*inputs)


@contextlib.contextmanager
def _no_constraint_check() -> Iterator[None]:
    """Export's check of the traced frame's shape constraints left out: it builds every guard of the
    frame only to report symbolic sizes the trace specialized, and a trace with static sizes (no
    symbolic input dim, no constraint passed) has none and uses no guard. It was 8-15% of a small
    model's capture (llama-tiny 0.15 of 1.9 s, qwen2 0.36 of 2.9 s, CPU time).

    NOTE: it swaps a module attribute of torch for the duration of the trace: two threads must not
    capture at once."""
    name = "_suggest_or_raise_constraint_violation"
    real = getattr(dynamo_export, name, None)
    if real is None:  # NOTE: a torch without the check: nothing to leave out
        yield
        return
    setattr(dynamo_export, name, lambda *_args, **_kwargs: None)
    try:
        yield
    finally:
        setattr(dynamo_export, name, real)
