"""Built-in zoo of small models used by tests, the CLI and demos (``meshfold.tools.zoo``).

Every entry is a factory returning ``(model, example_inputs)`` where
``model(*example_inputs)`` is a scalar fp32 loss. Factories are deterministic
(weights under ``torch.manual_seed(0)``, inputs from a generator seeded with 0)
and construct nothing data-dependent, so they also run under ``FakeTensorMode``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

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


# NOTE: imported last: the entries register themselves with the registry above.
from meshfold.tools.zoo import hf, hybrid, models, moe  # noqa: E402, F401
