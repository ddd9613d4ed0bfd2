"""``meshfold.rewrites.fuse_attention``: attention written out as ``softmax(Q Kᵀ · scale + mask) V`` becomes one
``scaled_dot_product_attention`` at capture, and only where that computes the same."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshfold import capture
from meshfold.backends.interpret import interpret

FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


class Written(nn.Module):
    """One attention written out; ``how`` picks a variant the fusion must leave alone."""

    def __init__(self, how: str = "plain") -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.how = how

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, 2, 8).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        if self.how == "tensor-scale":
            w = q @ k.transpose(-2, -1) / torch.full([], math.sqrt(8.0))
        elif self.how == "divided":
            w = mask + torch.matmul(q, k.transpose(2, 3)) / math.sqrt(8.0)
        else:
            w = torch.matmul(q, k.transpose(2, 3)) * 8**-0.5 + mask
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        p = F.dropout(p, p=0.1 if self.how == "dropout" else 0.0, training=True)
        out = torch.matmul(p, v).transpose(1, 2).reshape(b, t, 16)
        loss = out.square().mean()
        return loss + p.sum() * 0.0 if self.how == "weights-read" else loss


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 16, generator=g)
    i = torch.arange(6)
    mask = torch.zeros(6, 6).masked_fill(i[None, :] > i[:, None], torch.finfo(torch.float32).min)
    return x, mask


@pytest.mark.parametrize("how", ["plain", "divided"])
def test_written_out_attention_becomes_one_kernel_and_computes_the_same(how: str) -> None:
    torch.manual_seed(0)
    model, inputs = Written(how), _inputs()
    g = capture(model, inputs)
    names = {op.name for op in g.ops}
    assert FLASH in names and "aten._softmax" not in names and "aten.bmm" not in names, sorted(names)
    loss = model(*inputs)
    loss.backward()
    feeds = {k: v.detach() for k, v in model.named_parameters()}
    feeds |= {i.name: x for i, x in zip((i for i in g.inputs if i.kind == "input"), inputs, strict=True)}
    got = interpret(g, feeds)
    torch.testing.assert_close(got[("out", "0")], loss.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[("grad", name)], p.grad, msg=name)


@pytest.mark.parametrize("how", ["tensor-scale", "dropout", "weights-read"])
def test_attention_the_kernel_would_change_stays_written_out(how: str) -> None:
    """A scale held in a tensor, dropout on the weights (other random numbers), weights read elsewhere."""
    torch.manual_seed(0)
    names = {op.name for op in capture(Written(how), _inputs()).ops}
    assert FLASH not in names and "aten._softmax" in names, sorted(names)


def test_softmax_in_another_dtype_stays_written_out() -> None:
    torch.manual_seed(0)
    model = Written().double()
    x, mask = _inputs()
    names = {op.name for op in capture(model, (x.double(), mask.double())).ops}
    assert FLASH not in names, sorted(names)
