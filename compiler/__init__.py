"""meshfold: compile a single-device PyTorch model into a multi-device training program.

This package is the front door (the ``compiler/`` folder); ``meshfold.ir``, ``meshfold.passes``,
``meshfold.backends`` and ``meshfold.tools`` are its subpackages. Names load on first use, so that
``meshfold plan`` (the pure-Python simulator) starts without importing torch.

``moe_experts`` is the marker for MoE code meshfold does not recognize: routed experts written as
one call of it (stacked ``[E, ...]`` weights) are folded like the experts it finds itself.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshfold.api import parallelize
    from meshfold.backends.watch import CollectiveError
    from meshfold.elastic import train
    from meshfold.ir.dialects.moe import experts as moe_experts
    from meshfold.packing import PackedBatch, doc_mask, pack_sequences
    from meshfold.passes.options import DEFAULT_PIPELINE, Options
    from meshfold.pp.pipelined import PipelinedModule
    from meshfold.runtime.crosscheck import VerificationError
    from meshfold.runtime.signature import CallMismatch
    from meshfold.session import CompileResult, compile_model
    from meshfold.tracing.tracer import CaptureError, capture

try:
    __version__ = version("meshfold")
except PackageNotFoundError:  # NOTE: running from a source tree that was never installed
    __version__ = "0+unknown"

_HOME = {
    "parallelize": ("meshfold.api", "parallelize"),
    "CaptureError": ("meshfold.tracing.tracer", "CaptureError"),
    "capture": ("meshfold.tracing.tracer", "capture"),
    "moe_experts": ("meshfold.ir.dialects.moe", "experts"),
    "pack_sequences": ("meshfold.packing", "pack_sequences"),
    "PackedBatch": ("meshfold.packing", "PackedBatch"),
    "PipelinedModule": ("meshfold.pp.pipelined", "PipelinedModule"),
    "doc_mask": ("meshfold.packing", "doc_mask"),
    "DEFAULT_PIPELINE": ("meshfold.passes.options", "DEFAULT_PIPELINE"),
    "Options": ("meshfold.passes.options", "Options"),
    "CompileResult": ("meshfold.session", "CompileResult"),
    "compile_model": ("meshfold.session", "compile_model"),
    "VerificationError": ("meshfold.runtime.crosscheck", "VerificationError"),
    "CallMismatch": ("meshfold.runtime.signature", "CallMismatch"),
    "CollectiveError": ("meshfold.backends.watch", "CollectiveError"),
    "train": ("meshfold.elastic", "train"),
}


def __getattr__(name: str) -> Any:
    where = _HOME.get(name)
    if where is None:
        raise AttributeError(f"module 'meshfold' has no attribute {name!r}")
    return getattr(importlib.import_module(where[0]), where[1])


__all__ = [
    "DEFAULT_PIPELINE",
    "CallMismatch",
    "CaptureError",
    "CollectiveError",
    "Options",
    "CompileResult",
    "PackedBatch",
    "PipelinedModule",
    "VerificationError",
    "__version__",
    "capture",
    "compile_model",
    "doc_mask",
    "moe_experts",
    "pack_sequences",
    "parallelize",
    "train",
]
