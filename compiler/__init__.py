"""meshfold's front door: capture a model, run pass pipelines, execute on a mesh.

``moe_experts`` is the marker for MoE code meshfold does not recognize: routed experts written as
one call of it (stacked ``[E, ...]`` weights) are folded like the experts it finds itself."""

from compiler.api import parallelize
from compiler.capture import CaptureError, capture
from compiler.pipeline import DEFAULT_PIPELINE, CompileResult, compile_model
from compiler.verify import VerificationError
from ir.moe import experts as moe_experts

__all__ = [
    "DEFAULT_PIPELINE",
    "CaptureError",
    "CompileResult",
    "VerificationError",
    "capture",
    "compile_model",
    "moe_experts",
    "parallelize",
]
