"""The one place passes are registered. ``default_registry()`` builds a fresh table every call."""

from __future__ import annotations

from meshfold.passes.base import Pass
from meshfold.passes.cleanup import Cleanup
from meshfold.passes.cp.steps import RingSteps
from meshfold.passes.float8 import Float8Gathers
from meshfold.passes.memory.activations import Memory
from meshfold.passes.moe.fold import MoeFold
from meshfold.passes.precision import Casts
from meshfold.passes.schedule.bucket import Bucket
from meshfold.passes.schedule.overlap import Overlap
from meshfold.passes.sharding.boxing import Boxing
from meshfold.passes.sharding.propagate import Sharding
from meshfold.passes.verify import Verify

_PASSES: tuple[type[Pass], ...] = (
    Cleanup,
    MoeFold,
    Sharding,
    Boxing,
    Casts,
    Float8Gathers,
    Bucket,
    Memory,
    RingSteps,
    Overlap,
    Verify,
)


def default_registry() -> dict[str, type[Pass]]:
    """Pass classes by name (a new dict: callers may extend it without affecting others)."""
    return {p.name: p for p in _PASSES}
