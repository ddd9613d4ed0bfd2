"""Passes over the IR. ``passes`` imports ``ir`` and never ``compiler``, ``backends`` or ``tools``.

Names load on first use, so that the pure-Python parts (``passes.cost.comm`` and ``passes.cost.opcost``,
which the simulator behind ``meshfold plan`` prices with) import without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshfold.passes.base import CLEAN, JOINT, VERIFIED, Pass, PassError, PassFailure
    from meshfold.passes.cleanup import Cleanup, eliminate_common_subexpressions, eliminate_dead_code
    from meshfold.passes.context import PassContext
    from meshfold.passes.pipeline import PassPipeline, PassTiming, parse_pipeline, parse_size, pass_spelling
    from meshfold.passes.registry import default_registry
    from meshfold.passes.verify import Verify

_HOME = {
    "meshfold.passes.base": ("CLEAN", "JOINT", "VERIFIED", "Pass", "PassError", "PassFailure"),
    "meshfold.passes.context": ("PassContext",),
    "meshfold.passes.options": ("Options",),
    "meshfold.passes.cleanup": ("Cleanup", "eliminate_common_subexpressions", "eliminate_dead_code"),
    "meshfold.passes.pipeline": ("PassPipeline", "PassTiming", "parse_pipeline", "parse_size", "pass_spelling"),
    "meshfold.passes.registry": ("default_registry",),
    "meshfold.passes.verify": ("Verify",),
}
_WHERE = {name: module for module, names in _HOME.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'passes' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CLEAN",
    "JOINT",
    "VERIFIED",
    "Cleanup",
    "Pass",
    "Options",
    "PassContext",
    "PassError",
    "PassFailure",
    "PassPipeline",
    "PassTiming",
    "Verify",
    "default_registry",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "parse_pipeline",
    "parse_size",
    "pass_spelling",
]
