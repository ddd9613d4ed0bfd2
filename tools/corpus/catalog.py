"""The corpus's entries: real model code (or a model drawn from the block grammar) built small, with
seeded random weights, returning its training loss."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Built = tuple[nn.Module, tuple[Any, ...]]

KINDS = ("decoder", "encoder", "encoder-decoder", "cnn", "moe", "hybrid", "generated")
"""What an entry's architecture is, the matrix's row groups in this order."""

TRAITS = frozenset({"attention", "moe", "stack", "tokens", "running-stats", "random", "deep"})
"""What an entry has that decides which plan families apply to it (``plans.Column.needs``):
``attention`` a softmax attention over a token sequence (context parallelism splits it); ``moe``
routed experts (expert parallelism); ``stack`` a layer stack of at least two layers (pipeline
stages); ``deep``: at least four (interleaved stages, two per rank); ``tokens`` inputs of token
ids over a sequence; ``running-stats`` buffers a forward updates (BatchNorm); ``random`` random
ops in training mode (dropout)."""


@dataclass(frozen=True)
class Entry:
    """One row of the matrix. ``build()`` returns ``(model, inputs)``, the same weights every call,
    where ``loss(model(*inputs))`` is the scalar fp32 training loss; ``source`` says whose code
    the model is (a ``transformers`` class, a torchtitan module, ours); ``requires`` the modules
    it imports (an entry whose modules are missing is skipped, not failed)."""

    name: str
    kind: str
    source: str
    build: Callable[[], Built]
    traits: frozenset[str] = frozenset()
    requires: tuple[str, ...] = ()
    loss: Callable[[Any], torch.Tensor] = field(default=lambda out: out)
    note: str = ""
    precision: str = "fp32"
    """What the model computes in: ``bf16`` where its own code casts to bf16 (torchtitan's grouped
    experts), which the cell compares at bf16's rounding (``cell.TOLERANCES``)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"corpus entry {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"corpus entry {self.name}: precision {self.precision!r} is not fp32 or bf16")
        if not self.traits <= TRAITS:
            raise ValueError(f"corpus entry {self.name}: unknown traits {sorted(self.traits - TRAITS)}")

    def available(self) -> bool:
        """Whether every module the entry needs is installed."""
        return all(_installed(m) for m in self.requires)


@functools.cache
def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


_ENTRIES: dict[str, Entry] = {}


def register(entry: Entry) -> Entry:
    """Add ``entry`` to the corpus (import time only)."""
    if entry.name in _ENTRIES:
        raise ValueError(f"corpus entry {entry.name!r} registered twice")
    _ENTRIES[entry.name] = entry
    return entry


def seeded(ctor: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """``ctor()`` under ``torch.manual_seed(seed)``, leaving the caller's generator as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ctor()


def tokens(vocab: int, batch: int = 8, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """``[batch, seq]`` token ids below ``vocab``, from a generator seeded with ``seed``."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
