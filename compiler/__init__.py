"""meshfold's front door: capture a model, run pass pipelines, (later) execute on a mesh."""

from compiler.capture import CaptureError, capture
from compiler.pipeline import DEFAULT_PIPELINE, CompileResult, compile_model

__all__ = ["DEFAULT_PIPELINE", "CaptureError", "CompileResult", "capture", "compile_model"]
