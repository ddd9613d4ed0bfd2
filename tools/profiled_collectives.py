"""The collectives one rank actually runs in a training step, by kind, as a profiler sees them.

:class:`CollectiveRecorder` is a ``TorchDispatchMode`` that sees every collective the rank issues:
the lowered programs' ``torch.ops._c10d_functional`` calls and the ``c10d`` calls the all-to-all
expert dispatcher makes (``dist.all_to_all_single``, with splits known only at run time). Layout
changes that lower to no collective (``comm.shard``, ``comm.partial``) never appear. Bytes are each
call's input tensor (``in``: what the profiler lists as the collective's input) and result
(``out``) on this rank. On gloo an all-gather runs as an all-to-all of its operand repeated once per
rank, a reduce-scatter as an all-to-all of its operand's blocks (``backends.collectives.issue``); each is
counted as the collective it is, with that collective's input and result bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshfold.backends.collectives import sent_by_all_to_all

_FUNCTIONAL_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    # NOTE: the in-place and out= forms Inductor's generated code calls
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}
# NOTE: eager c10d ops: (kind, index of the output argument, index of the input argument)
_C10D_KINDS = {
    "alltoall_base_": ("all_to_all", 0, 1),
    "allreduce_": ("all_reduce", 0, 0),
    "_allgather_base_": ("all_gather", 0, 1),
    "allgather_": ("all_gather", 0, 1),
    "_reduce_scatter_base_": ("reduce_scatter", 0, 1),
    "reduce_scatter_": ("reduce_scatter", 0, 1),
    "broadcast_": ("broadcast", 0, 0),
}


@dataclass(frozen=True)
class CollectiveCall:
    """One collective this rank ran: its kind, process group name, phase and bytes in / out."""

    kind: str
    group: str
    phase: str
    in_bytes: int
    out_bytes: int


@dataclass(frozen=True)
class CollectiveRow:
    """The calls of one kind over one group in one phase, summed."""

    kind: str
    group: str
    phase: str
    count: int
    in_bytes: int
    out_bytes: int


def _bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(y) for y in x)
    return 0


def _group_of(args: Sequence[Any]) -> str:
    """The process group's name: a functional collective's last string argument, or the group an
    eager ``c10d`` op receives (boxed as a ``ScriptObject``)."""
    import torch.distributed as dist

    for a in reversed(args):
        if isinstance(a, str):
            return a
        if isinstance(a, torch.ScriptObject):
            try:
                return str(dist.ProcessGroup.unbox(a).group_name)
            except RuntimeError:  # NOTE: another boxed argument (the ReduceOp of an all-reduce)
                continue
    return "?"


def classify(func: Any, args: Sequence[Any], result: Any) -> tuple[str, str, int, int] | None:
    """(kind, group, in bytes, out bytes) when ``func`` is a collective, else None (``wait_tensor`` included)."""
    namespace = getattr(func, "namespace", "")
    name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else ""
    sent_for = sent_by_all_to_all() if namespace == "_c10d_functional" and name == "all_to_all_single" else None
    if sent_for == "all_gather":  # NOTE: on gloo, an all-to-all of the operand repeated once per rank
        return sent_for, _group_of(args), _bytes(args[0]) // len(args[1]), _bytes(result)
    if sent_for == "reduce_scatter":  # NOTE: on gloo, an all-to-all of the operand's blocks, summed after
        return sent_for, _group_of(args), _bytes(args[0]), _bytes(result) // len(args[1])
    if namespace == "_c10d_functional" and name in _FUNCTIONAL_KINDS:
        return _FUNCTIONAL_KINDS[name], _group_of(args), _bytes(args[0]), _bytes(result)
    if namespace == "c10d" and name in _C10D_KINDS:
        kind, out_i, in_i = _C10D_KINDS[name]
        return kind, _group_of(args), _bytes(args[in_i]), _bytes(args[out_i])
    return None


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective run while active; ``phase(name)`` labels the calls made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []
        self._phase = "step"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the collectives run inside with ``name`` (``fwd``, ``bwd``)."""
        before, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = before

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        found = classify(func, args, result)
        if found is not None:
            kind, group, n_in, n_out = found
            self.calls.append(CollectiveCall(kind, group, self._phase, n_in, n_out))
        return result


def summarize(calls: Sequence[CollectiveCall], group_names: Mapping[str, str]) -> list[CollectiveRow]:
    """Calls summed by (kind, group, phase) in order of first appearance; ``group_names`` renames
    process groups (``{group_name: "tp"}``), others keep their own name."""
    rows: dict[tuple[str, str, str], list[int]] = {}
    for c in calls:
        key = (c.kind, group_names.get(c.group, c.group), c.phase)
        acc = rows.setdefault(key, [0, 0, 0])
        acc[0] += 1
        acc[1] += c.in_bytes
        acc[2] += c.out_bytes
    return [CollectiveRow(k, g, p, n, i, o) for (k, g, p), (n, i, o) in rows.items()]


def group_labels(mesh: Any, groups: Iterable[str]) -> dict[str, str]:
    """``{process group name: label}``: a ``DeviceMesh`` axis name for the mesh's groups, ``ranks 0,1,..``
    for any other group (the experts' own mapping), else the group's own name."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    axes = {mesh.get_group(a).group_name: a for a in mesh.mesh_dim_names or ()}
    out: dict[str, str] = {}
    for g in groups:
        if g in axes:
            out[g] = axes[g]
            continue
        try:
            out[g] = "ranks " + ",".join(map(str, dist.get_process_group_ranks(_resolve_process_group(g))))
        except (ValueError, RuntimeError, KeyError):
            out[g] = g
    return out
