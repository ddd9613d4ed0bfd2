"""``meshfold.rewrites.fuse_conv``: a causal convolution written as a padded ``conv1d`` cut back to the sequence
becomes one ``meshfold.causal_conv1d`` at capture (computing the same), other convolutions stay as
they are; the op's gradient; its sequence split over ranks (``backends/context_parallel/halo.py``) gives the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshfold import capture
from tests.models.test_capture import assert_graph_matches_eager


class Convolved(nn.Module):
    """A projection, a depthwise convolution along the sequence and a loss; ``how`` picks the form:
    ``"module"`` (an ``nn.Conv1d`` with ``padding=K - 1``, cut to the sequence), ``"function"``
    (``F.conv1d`` without a bias), ``"centred"`` (padding ``K // 2``: not causal) and ``"uncut"``
    (the padded output kept whole)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Linear(8, 6)
        self.conv = nn.Conv1d(6, 6, 4, groups=6, padding=2 if how == "centred" else 3, bias=how != "function")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).transpose(1, 2)
        t = h.shape[-1]
        if self.how == "function":
            y = F.conv1d(h, self.conv.weight, None, padding=3, groups=6)[..., :t]
        elif self.how == "uncut":
            y = self.conv(h)
        else:
            y = self.conv(h)[:, :, :t]
        return F.silu(y).square().mean()


def _built(how: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Convolved(how), (torch.randn(2, 12, 8),)


@pytest.mark.parametrize("how", ["module", "function"])
def test_causal_convolution_is_one_op_and_computes_the_same(how: str) -> None:
    g = capture(*_built(how))
    names = [op.name for op in g.ops]
    assert names.count("meshfold.causal_conv1d") == 1 and names.count("meshfold.causal_conv1d_backward") == 1
    assert "aten.convolution" not in names
    assert_graph_matches_eager(g, *_built(how))


@pytest.mark.parametrize("how", ["centred", "uncut"])
def test_other_convolutions_are_left_as_they_are(how: str) -> None:
    g = capture(*_built(how))
    assert "meshfold.causal_conv1d" not in {op.name for op in g.ops}
    assert_graph_matches_eager(g, *_built(how))


def test_causal_conv_gradient_and_shapes() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 1, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    expected = F.conv1d(x, w, b, padding=3, groups=3)[..., :10]
    torch.testing.assert_close(torch.ops.meshfold.causal_conv1d(x, w, b), expected)
    assert torch.autograd.gradcheck(torch.ops.meshfold.causal_conv1d, (x, w, b))
    with pytest.raises(ValueError, match=r"bias \[C\]; got x \[2, 3, 10\], w \[4, 1, 4\]"):
        torch.ops.meshfold.causal_conv1d(x, torch.zeros(4, 1, 4, dtype=torch.float64), b)
