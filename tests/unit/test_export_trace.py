"""Dynamo's export trace (``meshfold.tracing.export_trace``): a capture with static sizes leaves out export's
shape-constraint check, which builds every guard of the traced frame; one with symbolic sizes keeps it."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch._dynamo.functional_export as dynamo_export

from meshfold import capture
from meshfold.tools.zoo import build

CHECK = "_suggest_or_raise_constraint_violation"


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = getattr(dynamo_export, CHECK)

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(dynamo_export, CHECK, counted)
    return calls


def test_a_static_capture_skips_the_constraint_check_and_gives_the_same_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = build("llama-tiny")
    calls = _counting(monkeypatch)
    without = capture(model, inputs)
    assert calls == []
    assert getattr(dynamo_export, CHECK).__name__ == "counted"  # NOTE: put back after the capture
    monkeypatch.setattr("meshfold.tracing.export_trace._no_constraint_check", contextlib.nullcontext)
    with_check = capture(model, inputs)
    assert calls == [1]
    assert str(with_check) == str(without)


def test_a_capture_asked_for_a_symbolic_size_keeps_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = build("mlp")
    calls = _counting(monkeypatch)
    capture(model, inputs, dynamic=[(0, 0)])
    assert calls == [1]
