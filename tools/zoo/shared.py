"""What the zoo's entries share: sizes, seeded construction, token inputs, init, the LM loss, the registry."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 2
SEQ = 16


def _seeded(ctor: Callable[[], nn.Module]) -> nn.Module:
    """Construct a module under ``torch.manual_seed(0)`` without leaking RNG state."""
    # NOTE: fork_rng restores the caller's global RNG, so building is side-effect free.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ctor()


def _token_inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(input_ids, labels)`` of shape [BATCH, SEQ]; labels equal the ids."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g, dtype=torch.long)
    return input_ids, input_ids.clone()


def _small_init(module: nn.Module) -> None:
    """GPT-style init: N(0, 0.02) for Linear/Embedding weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM cross-entropy: position t predicts label t+1, computed in fp32."""
    vocab = logits.size(-1)
    shift_logits = logits[:, :-1, :].reshape(-1, vocab).float()
    shift_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits, shift_labels)


ZooFactory = Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]

_REGISTRY: dict[str, ZooFactory] = {}


def register(name: str) -> Callable[[ZooFactory], ZooFactory]:
    """Register a zoo factory under ``name`` (import time only)."""

    def deco(fn: ZooFactory) -> ZooFactory:
        if name in _REGISTRY:
            raise ValueError(f"zoo model {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def zoo_names() -> list[str]:
    """Return the sorted names of all zoo models."""
    return sorted(_REGISTRY)


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build zoo model ``name`` and its example inputs."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(zoo_names())}") from None
    return factory()
