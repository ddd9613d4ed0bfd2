"""The rank tasks' capture sharing (``tests.dist.captures``): a second compile of the same model and
inputs in one process takes the first's graph; other inputs, another mode, another dtype or a
compile outside the block capture anew."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import meshfold.session as session
from meshfold.passes.options import Options
from meshfold.session import compile_model
from meshfold.tools.zoo import build
from tests.dist import captures


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every real capture's inputs' shapes, and an empty memo for the test."""
    calls: list[tuple[Any, ...]] = []
    real = session.capture

    def capture(model: torch.nn.Module, inputs: tuple[Any, ...], **kw: Any) -> Any:
        calls.append(tuple(x.shape for x in inputs))
        return real(model, inputs, **kw)

    monkeypatch.setattr(session, "capture", capture)
    monkeypatch.setattr(captures, "_GRAPHS", {})
    return calls


def _compiled(net: torch.nn.Module, inputs: tuple[Any, ...], plan: str = "ddp") -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_model(net, inputs, Options.of(mesh="dp=2", plan=plan))


def test_one_capture_per_model_inputs_and_mode(counted: list[tuple[Any, ...]]) -> None:
    net, inputs = build("mlp")
    with captures.shared_capture("zoo:mlp"):
        first = _compiled(net, inputs)
        again = _compiled(build("mlp")[0], inputs, plan="fsdp")
    assert len(counted) == 1
    assert again.captured is first.captured
    layouts = [{i.name: i.value.layout for i in r.graph.inputs if i.kind == "param"} for r in (first, again)]
    assert layouts[0] != layouts[1]  # NOTE: the plan still applies
    with captures.shared_capture("zoo:mlp"):
        _compiled(net, tuple(torch.cat([x, x]) for x in inputs))  # NOTE: other shapes
        _compiled(net.double(), tuple(x.double() if x.is_floating_point() else x for x in inputs))
        _compiled(net.float().eval(), inputs)
        other = tuple(x + 1 if x.is_floating_point() else x for x in inputs)
        _compiled(net.train(), other)  # NOTE: other values
    assert len(counted) == 5
    _compiled(net, inputs)  # NOTE: outside the block
    assert len(counted) == 6
