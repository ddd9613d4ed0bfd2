"""Models outside the zoo that capture must also handle: conv + BatchNorm, LSTM/GRU, nn.Transformer,
bf16 with a tuple output. Each factory returns ``(model, example_inputs)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CNN(nn.Module):
    """Conv, BatchNorm (running stats updated in place), pooling, dropout, cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2)
        self.fc = nn.Linear(8 * 3 * 3, 10)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        h = F.adaptive_avg_pool2d(self.drop(F.relu(self.c2(h))), 3)
        return F.cross_entropy(self.fc(h.flatten(1)), y)


class RNN(nn.Module):
    """Embedding, LSTM then GRU, token cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.gru = nn.GRU(32, 16, batch_first=True)
        self.out = nn.Linear(16, 50)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(x))
        h, _ = self.gru(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


class TX(nn.Module):
    """torch.nn.TransformerEncoder, two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 50)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.enc(self.emb(x))).flatten(0, 1), y.flatten())


class TupleOut(nn.Module):
    """A bf16 layer returning (loss, activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h.float().pow(2).mean(), h


def cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return CNN(), (torch.randn(2, 3, 12, 12), torch.randint(0, 10, (2,)))


def rnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return RNN(), (torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 7)))


def tx() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return TX(), (torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 7)))


def tup() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return TupleOut(), (torch.randn(4, 8, dtype=torch.bfloat16),)


class ScalarArg(nn.Module):
    """Takes a Python float besides the tensor and returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
        h = self.lin(x) * scale
        return {"loss": h.pow(2).mean(), "h": h}


def scalar_arg() -> tuple[nn.Module, tuple[torch.Tensor | float, ...]]:
    return ScalarArg(), (torch.randn(2, 4), 3.0)
