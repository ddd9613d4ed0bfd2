"""One capture per model and inputs in a rank's process, shared by the rank tasks that compile it.

The rank pool keeps its processes from test to test, and most rank tests compile a model an
earlier test compiled already, under another plan, mesh or memory policy. What ``compile_model``
captures depends on the model and its example inputs only (it captures before any pass runs), so a
task whose model is built deterministically from a name (the zoo's, ``tests.dist.hf_models``')
compiles inside ``shared_capture(name)``, and a capture of the same model, inputs and mode made
earlier in this process is used again. The first compile of each in a process captures for real;
``tests/unit`` checks the capture itself. A dynamic-shape capture (which reports guards) and every
capture outside the block run as usual.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

import meshfold.session as session
from meshfold import ir

_GRAPHS: dict[Hashable, ir.Graph] = {}
"""Graphs captured in this process, by ``_key``."""
LIMIT = 64
"""At most this many graphs kept (the oldest dropped first): tiny models' graphs, a few MB in all."""


def _key(name: str, model: torch.nn.Module, inputs: Sequence[Any]) -> Hashable:
    """Everything the capture of ``model`` (built as ``name``) on ``inputs`` depends on: the model's
    class, every parameter's and buffer's name, shape and dtype, each input's shape, dtype and
    contents, the mode and whether autograd records."""
    tensors = [(n, tuple(t.shape), t.dtype) for n, t in (*model.named_parameters(), *model.named_buffers())]
    args = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            digest = hashlib.sha1(x.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            args.append((tuple(x.shape), x.dtype, digest))
        else:
            args.append(("value", repr(x)))
    return (name, type(model).__qualname__, tuple(tensors), tuple(args), model.training, torch.is_grad_enabled())


@contextlib.contextmanager
def shared_capture(name: str) -> Iterator[None]:
    """Inside the block, ``compile_model`` captures a model it was given (built as ``name``) once
    per process for each set of inputs and mode (see the module docstring)."""
    real = session.capture

    def capture(model: torch.nn.Module, inputs: tuple[Any, ...], **kw: Any) -> ir.Graph:
        if kw.get("dynamic"):
            return real(model, inputs, **kw)
        key = _key(name, model, inputs)
        graph = _GRAPHS.get(key)
        if graph is None:
            graph = real(model, inputs, **kw)
            while len(_GRAPHS) >= LIMIT:
                del _GRAPHS[next(iter(_GRAPHS))]
            _GRAPHS[key] = graph
        return graph

    session.capture = capture  # type: ignore[assignment]
    try:
        yield
    finally:
        session.capture = real  # type: ignore[assignment]
