"""Answers kept by the identity of what they are about.

The passes ask the same question of the same long-lived object once per op of the graph (whether
an ATen overload is pure, which rewrite patterns apply to it, whether a sharding strategy splits
the work), at every layer alike. Hashing an overload or a frozen dataclass is a Python call, so a
dictionary keyed by the object itself costs about as much as the answer; one keyed by ``id`` costs a
C hash. Each entry holds its object, so the id is never another live object's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

Kept = dict[int, tuple[K, V]]
"""A ``by_identity`` store: ``id(key)`` → (key, answer)."""


def by_identity(kept: Kept[K, V], key: K, make: Callable[[K], V]) -> V:
    """``make(key)``, computed once per object ``key`` and kept in ``kept``."""
    hit = kept.get(id(key))
    if hit is None or hit[0] is not key:
        hit = kept[id(key)] = (key, make(key))
    return hit[1]
