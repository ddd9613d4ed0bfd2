"""The one place passes are registered. ``default_registry()`` builds a fresh table every call."""

from __future__ import annotations

from passes.base import Pass
from passes.cleanup import Cleanup
from passes.schedule.bucket import Bucket
from passes.sharding.boxing import Boxing
from passes.sharding.propagate import Sharding
from passes.verify import Verify

_PASSES: tuple[type[Pass], ...] = (Cleanup, Sharding, Boxing, Bucket, Verify)


def default_registry() -> dict[str, type[Pass]]:
    """Pass classes by name (a new dict: callers may extend it without affecting others)."""
    return {p.name: p for p in _PASSES}
