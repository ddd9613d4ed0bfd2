"""What a compiled program was compiled for, and the agreement of every rank on each call.

A ``ParallelModule`` holds one program per call signature: each tensor input's shape, dtype, device
and ``requires_grad``, the other inputs' values (dynamo bakes them into the graph), the module's
mode (train or eval) and whether autograd records (``torch.no_grad``/``inference_mode`` get a
forward-only program). A call whose signature differs from every program held gets a new one.

Every rank must run the same program: a rank that runs another one (or none) leaves the others
waiting in a collective. ``agree`` therefore makes every call start with one all-reduce that
carries each rank's signature hash and whether its call can run at all; when any rank differs,
every rank raises the same ``CallMismatch`` before any collective of the program.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from meshfold import ir
from meshfold.backends.watch import CollectiveError
from meshfold.passes import PassError


class CallMismatch(PassError):
    """A call that no program can run (raised on every rank alike)."""


@dataclass(frozen=True)
class Signature:
    """One call's inputs and mode, as a program is compiled for them."""

    inputs: tuple[tuple[Any, ...], ...]
    """Per positional input: ``("tensor", shape, dtype, device type, requires_grad)`` or ``("value", repr)``."""
    training: bool
    grad: bool
    autocast: tuple[tuple[str, str], ...] = ()
    """``(device type, dtype)`` of every device ``torch.autocast`` is on for: a program captured under
    it has autocast's casts in its graph, and runs with autocast off."""

    @staticmethod
    def of(inputs: Sequence[Any], training: bool, grad: bool | None = None) -> Signature:
        """The call's signature, in the grad and autocast state it is made in (``grad``: given)."""
        specs = tuple(
            ("tensor", tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
            if isinstance(x, torch.Tensor)
            else ("value", _value_text(x))
            for x in inputs
        )
        return Signature(specs, training, torch.is_grad_enabled() if grad is None else grad, autocast_state())

    def digest(self) -> int:
        """A 62-bit hash, equal on every rank for equal signatures (unlike ``hash``, which is salted)."""
        raw = hashlib.blake2b(repr(self).encode(), digest_size=8).digest()
        return int.from_bytes(raw, "little") >> 2

    def mode(self) -> str:
        casts = "".join(f", autocast {d} {ir.dtype_name(getattr(torch, t))}" for d, t in self.autocast)
        return f"{'train' if self.training else 'eval'}{'' if self.grad else ', no grad'}{casts}"

    def describe(self, names: Sequence[str] = ()) -> str:
        parts = []
        for i, spec in enumerate(self.inputs):
            name = names[i] if i < len(names) else f"arg{i}"
            if spec[0] == "tensor":
                grad = " requiring grad" if spec[4] else ""
                parts.append(f"{name}: {ir.dtype_name(spec[2])}{list(spec[1])}{grad}")
            else:
                parts.append(f"{name}={spec[1]}")
        return f"({', '.join(parts)}) in {self.mode()} mode"

    def difference(self, other: Signature, names: Sequence[str] = ()) -> str:
        """The first input (or the mode) in which ``self`` differs from ``other``, in words."""
        for i, (a, b) in enumerate(zip(self.inputs, other.inputs, strict=False)):
            if a == b:
                continue
            name = names[i] if i < len(names) else f"arg{i}"
            if a[0] == b[0] == "tensor":
                if a[1] != b[1]:
                    return f"input {name!r} has shape {list(a[1])}; the program was compiled for {list(b[1])}"
                if a[2] != b[2]:
                    return (
                        f"input {name!r} is {ir.dtype_name(a[2])}; the program was compiled for {ir.dtype_name(b[2])}"
                    )
                return f"input {name!r} differs ({a[3]}, requires_grad={a[4]}; compiled: {b[3]}, requires_grad={b[4]})"
            given, was = (x[1] if x[0] == "value" else "a tensor" for x in (a, b))
            return f"input {name!r} is {given}; the program was compiled for {was}"
        if len(self.inputs) != len(other.inputs):
            return f"the call has {len(self.inputs)} inputs; the program was compiled for {len(other.inputs)}"
        return f"the module is in {self.mode()} mode; the program was compiled in {other.mode()} mode"


AUTOCAST_DEVICES = ("cpu", "cuda")
"""The device types whose ``torch.autocast`` state a call's signature records."""


def autocast_state() -> tuple[tuple[str, str], ...]:
    """``(device type, dtype name)`` for each device type autocast is on for now."""
    return tuple(
        (d, str(torch.get_autocast_dtype(d)).removeprefix("torch."))
        for d in AUTOCAST_DEVICES
        if torch.is_autocast_enabled(d)
    )


def under_autocast(state: tuple[tuple[str, str], ...]) -> contextlib.ExitStack:
    """A context in which autocast is on exactly for ``state``'s devices (with its dtypes), off for the
    others: what a program of that signature is captured in."""
    stack = contextlib.ExitStack()
    on = dict(state)
    for d in AUTOCAST_DEVICES:
        if d in on:
            stack.enter_context(torch.autocast(d, dtype=getattr(torch, on[d])))
        elif torch.is_autocast_enabled(d):
            stack.enter_context(torch.autocast(d, enabled=False))
    return stack


def autocast_off() -> contextlib.ExitStack:
    """A context with autocast off on every device: what a program runs in (its casts are its own ops)."""
    return under_autocast(())


def _value_text(x: object) -> str:
    """A non-tensor argument as the signature keys it: plain values by ``repr``, containers by their
    items, tensors inside them by shape and dtype, other objects by type (an address differs per rank)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    if isinstance(x, torch.Tensor):
        return f"{ir.dtype_name(x.dtype)}{list(x.shape)}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_value_text(v) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{_value_text(k)}: {_value_text(v)}" for k, v in x.items()) + "}"
    return f"<{type(x).__module__}.{type(x).__qualname__}>"


def arg_names(model: torch.nn.Module) -> list[str]:
    """The names of ``model.forward``'s positional parameters (for messages)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a small tensor of a collective over ``group`` (default: the world) must live: host memory
    where the group's backend takes it (gloo, or a ``"cpu:gloo,cuda:nccl"`` pair), else the current
    accelerator (an NCCL-only world on CUDA ranks)."""
    backend = str(dist.get_backend(group))
    acc = torch.accelerator.current_accelerator()
    if "gloo" in backend or acc is None:
        return torch.device("cpu")
    return torch.device(acc.type, torch.accelerator.current_device_index())


def agree(
    sig: Signature, problem: str | None, names: Sequence[str] = (), group: dist.ProcessGroup | None = None
) -> None:
    """Raise ``CallMismatch`` on every rank when any rank's ``problem`` is set or the ranks' signatures
    differ. NOTE: one all-reduce of three integers per call; messages are gathered only on failure."""
    h = sig.digest()
    world = group if group is not None else dist.group.WORLD
    flags = torch.tensor([1 if problem else 0, h, -h], dtype=torch.int64, device=collective_device(world))
    # NOTE: a functional collective, like every other the program runs (profilers and the demo's
    # table see it as one small all-reduce over the world)
    try:
        got = funcol.all_reduce(flags, "max", world).tolist()
    except RuntimeError as e:
        raise CollectiveError(
            f"the call check (an all_reduce over all {dist.get_world_size()} ranks before each call) did not "
            f"complete: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}. A rank is not "
            "calling the module (stuck: look at what it is doing) or has exited; a longer wait: "
            "parallelize(..., timeout=)"
        ) from e
    failed, most, least = int(got[0]), int(got[1]), -int(got[2])
    if not failed and most == least:
        return
    said: list[tuple[str | None, str]] = [(None, "")] * dist.get_world_size()
    dist.all_gather_object(said, (problem, sig.describe(names)), group=world)
    if failed:
        rank, first = next((r, m) for r, (m, _) in enumerate(said) if m)
        raise CallMismatch(f"rank {rank}: {first}")
    calls = "; ".join(f"rank {r}: {d}" for r, (_, d) in enumerate(said))
    raise CallMismatch(
        f"the ranks called the module with different inputs ({calls}); every rank must be given the same "
        "global inputs (meshfold splits them by the plan)"
    )
