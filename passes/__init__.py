"""Passes over the IR. ``passes`` imports ``ir`` and never ``compiler``, ``backends`` or ``tools``."""

from passes.base import CLEAN, JOINT, VERIFIED, Pass, PassContext, PassError, PassFailure
from passes.cleanup import Cleanup, eliminate_common_subexpressions, eliminate_dead_code
from passes.pipeline import PassPipeline, PassTiming, parse_pipeline, parse_size, pass_spelling
from passes.registry import default_registry
from passes.verify import Verify

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
