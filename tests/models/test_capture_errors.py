"""``CaptureError`` says what went wrong in the user's terms: the parameter by its FQN, the input by its
name, the op and the operands' shapes, the line of the model's own code, and the right diagnosis."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from meshfold import CaptureError, capture


class _AddsToWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin.weight.add_(1)  # mutates
        return self.lin(x).sum()


class _AddsToWeightNoGrad(_AddsToWeight):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.add_(1)  # mutates
        return self.lin(x).sum()


class _AddsToInput(_AddsToWeight):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)  # mutates
        return self.lin(x).sum()


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(3))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.bias  # mismatched


class _BadBroadcast(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.lin(x)).sum()


class _RaisesInTry(_AddsToWeight):
    """Code whose exception leaves a try block (as transformers' output-collecting wrapper has one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scales: dict[str, Any] = {"traced": None}
        try:
            return self.lin(x).sum() * scales["traced"][0]
        finally:
            scales.clear()  # the try block ends


def _line(cls: type, marker: str) -> str:
    lines, start = inspect.getsourcelines(cls)
    return f"test_capture_errors.py:{start + next(i for i, ln in enumerate(lines) if marker in ln)}"


def _error(model: torch.nn.Module) -> str:
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(2, 4),))
    return str(info.value)


@pytest.mark.parametrize("cls", [_AddsToWeight, _AddsToWeightNoGrad], ids=["requires-grad", "under-no-grad"])
def test_parameter_mutation_names_the_parameter_by_fqn(cls: type) -> None:
    msg = _error(cls())
    assert "parameter `lin.weight`" in msg, msg
    assert "in place" in msg or "in-place" in msg
    assert _line(cls, "# mutates") in msg
    assert "L__self__" not in msg and "ParamAOTInput" not in msg  # NOTE: dynamo's own names stay hidden
    assert "user input" not in msg and "input `" not in msg
    assert "optimizer step" in msg  # NOTE: says what to do


def test_input_mutation_names_the_argument() -> None:
    msg = _error(_AddsToInput())
    assert "input `x` in place" in msg, msg
    assert "parameter" not in msg and "PlainAOTInput" not in msg
    assert _line(_AddsToInput, "# mutates") in msg


def test_broadcasting_bug_is_a_shape_error_not_a_mutation() -> None:
    msg = _error(_BadBroadcast())
    assert "mutation" not in msg and "in-place" not in msg, msg
    assert "shapes do not fit" in msg
    assert "`+` on operands of shapes [2, 4] and [3]" in msg  # NOTE: the op and its operands' shapes
    assert "in module `inner`" in msg
    assert _line(_Inner, "# mismatched") in msg
    assert "broadcast" in msg  # NOTE: torch's own reason is kept


def test_an_exception_the_model_raises_under_tracing_is_named_not_taken_for_a_mutation() -> None:
    msg = _error(_RaisesInTry())
    assert "mutation" not in msg and "in-place" not in msg, msg
    assert "a Python exception (TypeError: 'NoneType' object is not subscriptable)" in msg
    assert _line(_RaisesInTry, "# the try block ends") in msg
    assert "run the model once in eager" in msg  # NOTE: says what to do
