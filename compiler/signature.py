"""What a compiled program was compiled for, checked on every call, on every rank alike.

A ``ParallelModule`` runs one program, lowered for its example inputs' shapes and dtypes and for the
model's mode at capture (train or eval). A call that differs (the last, smaller batch; an eval pass
at another length; a bf16 input to an fp32 model; ``pm.eval()``) would run the wrong program: a
reshape error from inside the graph, a hang when one rank's collectives no longer match the
others', or a silently different result. ``CallSpec.mismatch`` says what differs before anything
runs, and ``agree`` makes every rank raise the same error when any rank's call differs, so no rank
is left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from meshfold import ir
from meshfold.ir.symbolic import Dim
from meshfold.passes import PassError


class CallMismatch(PassError):
    """A call differs from what the program was compiled for (raised on every rank alike)."""


@dataclass(frozen=True)
class CallSpec:
    """Each tensor input's name, global shape and dtype, and the mode, as compiled."""

    inputs: tuple[tuple[str, tuple[Dim, ...], torch.dtype], ...]
    training: bool

    @staticmethod
    def of(graph: ir.Graph, training: bool) -> CallSpec:
        """The spec of ``graph``'s user inputs (kind ``input``, in call order)."""
        specs = tuple(
            (i.name, tuple(i.value.type.shape), i.value.type.dtype)
            for i in graph.inputs
            if i.kind == "input" and isinstance(i.value.type, ir.TensorType)
        )
        return CallSpec(specs, training)

    def mismatch(self, inputs: Sequence[Any], training: bool) -> str | None:
        """One line naming what differs (the input, the compiled and the given), and what to do;
        None when the call is what the program was compiled for."""
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        if len(tensors) != len(self.inputs):
            return (
                f"the program was compiled for {len(self.inputs)} tensor inputs and was called with {len(tensors)}; "
                "call it as the example inputs were given"
            )
        for (name, shape, dtype), x in zip(self.inputs, tensors, strict=True):
            given = tuple(x.shape)
            if not _fits(shape, given):
                return (
                    f"input {name!r} has shape {list(given)}; the program was compiled for {list(shape)}. "
                    "Call it with that shape (pad or drop a last, smaller batch), or compile another program "
                    "with parallelize(model, mesh, example_inputs of the new shape)"
                )
            if x.dtype != dtype:
                return (
                    f"input {name!r} is {ir.dtype_name(x.dtype)}; the program was compiled for {ir.dtype_name(dtype)} "
                    f"(the single-device model would not take it either); convert it, or compile for {x.dtype}"
                )
        if training != self.training:
            mode, other = ("train", "eval") if self.training else ("eval", "train")
            return (
                f"the module is in {other} mode; the program was captured in {mode} mode (dropout and batch "
                f"statistics differ); for {other}, compile the model in that mode: "
                f"parallelize(model.{other}(), ...)"
            )
        return None


def _fits(compiled: tuple[Dim, ...], given: tuple[int, ...]) -> bool:
    """Whether ``given`` is ``compiled``, a symbolic size matching any value."""
    if len(compiled) != len(given):
        return False
    return all(not isinstance(c, int) or c == g for c, g in zip(compiled, given, strict=True))


def agree(problem: str | None) -> None:
    """Raise ``CallMismatch`` on every rank when any rank's ``problem`` is set. NOTE: one all-reduce
    of one integer per call; the messages themselves are gathered only when one is set."""
    flag = torch.tensor([1 if problem else 0], dtype=torch.int32)
    # NOTE: a functional collective, like every other the program runs (profilers and the demo's
    # table see it as one all-reduce of 4 bytes over the world)
    if int(funcol.all_reduce(flag, "max", dist.group.WORLD).item()) == 0:
        return
    said: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(said, problem)
    rank, first = next((r, m) for r, m in enumerate(said) if m)
    raise CallMismatch(f"rank {rank}: {first}")
