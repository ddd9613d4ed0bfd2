"""Where ``mem.offload`` puts an activation and how ``mem.reload`` brings it back.

On CUDA the tier is pinned host memory and both copies run on one side stream per device, so they
overlap the kernels the compute stream has queued. ``offload`` orders its copy after the work that
produced the value and marks the value used by the copy stream (``record_stream``): the caching
allocator reuses its block only once the copy is done, which is when the forward may drop it.
``reload`` allocates the device copy on the copy stream (so it needs no wait for the compute
stream's queued work: the allocator orders the block's reuse by stream), copies, marks the copy
used by the compute stream, and records an event on the copy stream; the compute stream waits for
that event before anything reads the copy (``reload_wait``). The copy engine runs it while the
compute stream is still on the kernels queued before, and where the overlap pass started the reload
a block ahead of its readers (a ``comm.wait`` on it), under that block's kernels too. A reload
queues on the same stream as the offload of its value, so the host bytes it reads are always
written first.

On CPU ranks the host *is* the device's memory, so the tier is a file: the tensor's bytes are
copied into a temporary file mapped into memory (``torch.from_file``, shared) and the file's name
is removed at once, so nothing is left on disk whatever happens to the process; the mapping lives
as long as the tensor. Its bytes are then outside the CPU allocator (the kernel may write them out
under memory pressure, as SSDTrain's tier does on purpose) and the allocator's peak falls by them.
``reload`` copies them back into ordinary memory (contiguous).
"""

from __future__ import annotations

import os
import tempfile

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}
"""The copy stream of each CUDA device (by index), made on first use."""


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


def offload(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values on the host tier, same shape (contiguous): pinned memory for a CUDA tensor
    (filled asynchronously, see the module doc), a file-backed tensor for a CPU one."""
    if x.device.type == "cuda":
        return _to_pinned(x)
    if x.device.type != "cpu":
        raise NotImplementedError(f"mem.offload from {x.device.type} memory is not supported (CUDA and CPU only)")
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
    """An offloaded tensor back where it came from: on the current CUDA device if it is pinned host
    memory (only CUDA offloads make those), else in ordinary CPU memory."""
    return reload_wait(reload_start(h))


def reload_start(h: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Issue ``reload(h)``: the copy and, on CUDA, the event that marks it done on the copy stream
    (the compute stream runs on meanwhile). A CPU rank's core makes the copy here and now."""
    if h.is_pinned():
        return _from_pinned(h, torch.device("cuda", torch.cuda.current_device()))
    return h.clone(), None


def reload_wait(started: tuple[torch.Tensor, torch.cuda.Event | None]) -> torch.Tensor:
    """The reloaded tensor, once the compute stream has been made to wait for its copy."""
    out, done = started
    if done is not None:
        torch.cuda.current_stream(out.device).wait_event(done)
    return out


def _to_pinned(x: torch.Tensor) -> torch.Tensor:
    stream = _copy_stream(x.device)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        host.copy_(x, non_blocking=True)
    x.record_stream(stream)
    return host


def _from_pinned(h: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
    stream = _copy_stream(device)
    with torch.cuda.stream(stream):
        out = torch.empty(h.shape, dtype=h.dtype, device=device)
        out.copy_(h, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    out.record_stream(torch.cuda.current_stream(device))
    return out, done
