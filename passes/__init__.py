"""Passes over the IR. ``passes`` imports ``ir`` and never ``compiler``, ``backends`` or ``tools``.

Names load on first use, so that ``passes.cost`` (pure Python: the simulator behind ``meshfold
plan``) can be imported without loading torch through the pass registry.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from passes.base import CLEAN, JOINT, VERIFIED, Pass, PassContext, PassError, PassFailure
    from passes.cleanup import Cleanup, eliminate_common_subexpressions, eliminate_dead_code
    from passes.pipeline import PassPipeline, PassTiming, parse_pipeline, parse_size, pass_spelling
    from passes.registry import default_registry
    from passes.verify import Verify

_HOME = {
    "passes.base": ("CLEAN", "JOINT", "VERIFIED", "Pass", "PassContext", "PassError", "PassFailure"),
    "passes.cleanup": ("Cleanup", "eliminate_common_subexpressions", "eliminate_dead_code"),
    "passes.pipeline": ("PassPipeline", "PassTiming", "parse_pipeline", "parse_size", "pass_spelling"),
    "passes.registry": ("default_registry",),
    "passes.verify": ("Verify",),
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
