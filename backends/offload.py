"""Where ``mem.offload`` puts an activation and how ``mem.reload`` brings it back.

On CPU ranks the host *is* the device's memory, so the tier is a file: the tensor's bytes are
copied into a temporary file mapped into memory (``torch.from_file``, shared) and the file's name
is removed at once, so nothing is left on disk whatever happens to the process; the mapping lives
as long as the tensor. Its bytes are then outside the CPU allocator (the kernel may write them out
under memory pressure, as SSDTrain's tier does on purpose) and the allocator's peak falls by them.
``reload`` copies them back into ordinary memory (contiguous). On CUDA the same ops would copy to
pinned host memory on a side stream; that path is not written yet and ``offload`` says so.
"""

from __future__ import annotations

import os
import tempfile

import torch


def offload(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a file-backed tensor of the same shape (contiguous)."""
    if x.device.type != "cpu":
        raise NotImplementedError(f"mem.offload from {x.device.type} memory is not supported yet (CPU ranks only)")
    nbytes = x.numel() * x.element_size()
    fd, path = tempfile.mkstemp(prefix="meshfold-offload-")
    try:
        os.ftruncate(fd, max(nbytes, 1))
        out = torch.from_file(path, shared=True, size=x.numel(), dtype=x.dtype)
    finally:
        os.close(fd)
        os.unlink(path)
    return out.view(x.shape).copy_(x)


def reload(h: torch.Tensor) -> torch.Tensor:
    """An offloaded tensor back in ordinary memory."""
    return h.clone()
