"""meshfold's front door: capture a model, run pass pipelines, (later) execute on a mesh."""

from compiler.api import parallelize
from compiler.capture import CaptureError, capture
from compiler.pipeline import DEFAULT_PIPELINE, CompileResult, compile_model
from compiler.verify import VerificationError

__all__ = [
    "DEFAULT_PIPELINE",
    "CaptureError",
    "CompileResult",
    "VerificationError",
    "capture",
    "compile_model",
    "parallelize",
]
