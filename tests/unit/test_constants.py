"""Tensor constants a forward makes (a Python list as an index, a scalar assigned into a slice) are
``meshfold.constant`` ops: printed and parsed with their values, checked by the verifier, run alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshfold import ir
from meshfold.ir.dialects.constant import MAX_ELEMENTS, constant
from meshfold.tracing.capture_errors import CaptureError
from meshfold.tracing.tracer import capture


class ListIndex(nn.Module):
    """Indexes with a Python list and assigns Python scalars into slices."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l(x)
        last = y[..., [-1, 2]]
        z = y.clone()
        z[:, 0] = 3.5
        z[:, 1:3] = -1
        return last.sum() + (z * z).mean()


def test_list_indices_and_scalars_in_slices_capture_as_constants() -> None:
    g = capture(ListIndex(), [torch.randn(4, 8)])
    text = str(g)
    assert "meshfold.constant([-1, 2], [], [2], torch.int64) : i64[2]" in text
    assert "meshfold.constant([], [3.5], [], torch.float32) : f32[]" in text
    assert str(ir.parse(text)) == text
    ir.verify(ir.parse(text))


def test_a_constant_runs_as_its_literal() -> None:
    torch.testing.assert_close(constant([1, 0, 7], [], [3, 1], torch.int64), torch.tensor([[1], [0], [7]]))
    torch.testing.assert_close(constant([1, 0], [], [2], torch.bool), torch.tensor([True, False]))
    torch.testing.assert_close(constant([], [0.25], [], torch.bfloat16), torch.tensor(0.25, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("literal", "message"),
    [
        ("[1, 2, 3], [], [2], torch.int64) : i64[2]", "needs 2 ints; it holds 3 ints"),
        ("[], [1.0, 2.0], [2], torch.int64) : i64[2]", "needs 2 ints; it holds 0 ints and 2 floats"),
        ("[1, 2], [], [2], torch.int64) : i64[3]", "i64[3]"),
    ],
)
def test_the_verifier_refuses_a_literal_that_disagrees_with_its_type(literal: str, message: str) -> None:
    text = f"graph @g {{\n  %c = meshfold.constant({literal}\n  output out(0) = %c\n}}\n"
    with pytest.raises(ir.VerifyError, match=r"line 2, column 3: meshfold\.constant") as caught:
        ir.verify(ir.parse(text))
    assert message in str(caught.value)


class Big(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tensor(list(range(MAX_ELEMENTS + 1)), dtype=torch.float32).sum()


def test_a_large_constant_is_refused_naming_where_and_what_to_do() -> None:
    with pytest.raises(
        CaptureError, match=r"makes a tensor constant at <root> \(fwd, test_constants\.py:\d+\).*buffer"
    ):
        capture(Big(), [torch.randn(2)])
