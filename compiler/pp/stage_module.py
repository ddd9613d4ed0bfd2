"""One pipeline stage's programs as what ``torch.distributed.pipelining`` runs: ``StageModule`` (a
module whose forward runs the stage's forward program) and ``StageStep`` (the autograd function whose
backward runs its backward program; under zero bubble the weights' part later, in the schedule's W
step), and, under ``verify``, what the first step records (``StageCheck``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from meshfold import ir
from meshfold.backends.eager import Lowered, RankContext, lower
from meshfold.backends.weights import lower_split
from meshfold.passes.stages import PipelineSpec
from meshfold.runtime.groups import dtensor_placements

if TYPE_CHECKING:
    from meshfold.pp.pipelined import PipelinedModule


@dataclass
class StepTime:
    """One ``step``'s wall time on this rank and the time its stages' programs ran in it; the rest is
    the pipeline's bubble (waiting for another stage), sends and receives included."""

    seconds: float = 0.0
    busy: float = 0.0

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy / self.seconds if self.seconds > 0 else 0.0


class StageStep(torch.autograd.Function):
    """A stage's forward program, its backward program as the backward."""

    @staticmethod
    def forward(ctx: Any, stage: StageModule, clock: StepTime, *tensors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        low = stage.low
        start = time.perf_counter()
        outs = low.forward(*tensors)
        clock.busy += time.perf_counter() - start
        ctx.stage, ctx.clock, ctx.microbatch = stage, clock, stage.forwards
        stage.forwards += 1
        if ctx.microbatch == 0 and low.fwd_recorded:
            stage.record(low.fwd_recorded, outs[1 + low.n_saved :], "forward")
        ctx.save_for_backward(*outs[1 : 1 + low.n_saved])
        return outs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        stage: StageModule = ctx.stage
        low = stage.low
        start = time.perf_counter()
        tangents = [stage.zero_tangents.get(name, grad) for name in low.bwd_inputs]
        outs = low.backward(*ctx.saved_tensors, *tangents)
        ctx.clock.busy += time.perf_counter() - start
        n = len(low.bwd_outputs)
        if ctx.microbatch == 0 and low.bwd_recorded:
            stage.record(low.bwd_recorded, outs[n + low.handoff :], "backward")
        if low.weights is not None:
            # NOTE: the weights' gradients later, in the schedule's W step (``StageModule.weight_step``)
            stage.pending.append((ctx.saved_tensors, tangents, outs[n : n + low.handoff], ctx.clock, ctx.microbatch))
        by_name = dict(zip(low.bwd_outputs, outs[:n], strict=True))
        return (None, None, *[by_name.get(name) for name in low.fwd_inputs])


class StageModule(nn.Module):
    """One stage's program as a module: ``forward(*received, **inputs)`` -> what it sends on (the
    last stage: the loss). Holds the owner's parameters it reads, so the schedule scales their
    gradients."""

    def __init__(self, owner: PipelinedModule, graph: ir.Graph, low: Lowered, taken: set[str]) -> None:
        super().__init__()
        self.low = low
        self._owner = (owner,)  # NOTE: a tuple, not a submodule
        self.pending: list[tuple[Any, ...]] = []
        self.forwards = 0
        """Forward calls in this step so far: the next one's microbatch."""
        self.recorded: list[tuple[tuple[ir.Value, ...], list[torch.Tensor], str]] = []
        """Under ``verify``, what a recording program (``lower(..., record=True)``) returned for the
        first microbatch: (values, this rank's tensors, phase) per module run."""
        self.kinds = {i.name: i.kind for i in graph.inputs}
        self.layouts = {i.name: i.value.layout for i in graph.inputs}
        # NOTE: the last stage returns the loss alone (``stages.loss_output``); the model's other outputs
        # get zero gradients, as a model output no backward reaches does on one device
        live = {f"tangent.{o.name}" for o in graph.outputs if o.kind == "out"}
        self.zero_tangents = {
            i.name: local_zeros(i.value, graph, owner.stage_mesh)
            for i in graph.inputs
            if i.kind == "tangent" and i.name.startswith("tangent.") and i.name not in live
        }
        for name in low.fwd_inputs:
            # NOTE: a weight two of this rank's stages read is scaled by the schedule once, in the first
            if self.kinds[name] == "param" and name not in taken:
                taken.add(name)
                self.register_parameter(name.replace(".", "__"), owner.get_parameter(name))

    def forward(self, *received: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        owner = self._owner[0]
        got = iter(received)
        tensors = []
        for name in self.low.fwd_inputs:
            kind = self.kinds[name]
            if kind in ("param", "buffer"):
                t = owner.get_parameter(name) if kind == "param" else owner.get_buffer(name)
                tensors.append(t.to_local() if isinstance(t, DTensor) else t)
            elif name in inputs:
                dt = distribute_tensor(
                    inputs[name], owner.stage_mesh, dtensor_placements(self.layouts[name]), src_data_rank=None
                )
                tensors.append(dt.to_local())
            else:
                tensors.append(next(got))
        return StageStep.apply(self, owner.last_step, *tensors)

    def record(self, values: tuple[ir.Value, ...], tensors: Sequence[torch.Tensor], phase: str) -> None:
        """Keep what a recording program returned (copies: a gradient among them is the parameter's
        ``.grad``, which the next microbatch adds to in place)."""
        self.recorded.append((values, [t.detach().clone() for t in tensors], phase))

    def weight_step(self) -> Any:
        """The W step of the backward just run (zero-bubble schedules): a function computing this
        stage's weights' gradients, adding them to the parameters' ``.grad``."""
        saved, tangents, handoff, clock, microbatch = self.pending.pop()
        low, owner = self.low, self._owner[0]
        assert low.weights is not None

        def run() -> None:
            start = time.perf_counter()
            outs = low.weights(*saved, *tangents, *handoff)  # type: ignore[misc]
            clock.busy += time.perf_counter() - start
            k = len(low.weight_outputs)
            if microbatch == 0 and low.weight_recorded:
                self.record(low.weight_recorded, outs[k:], "backward")
            for name, g in zip(low.weight_outputs, outs[:k], strict=True):
                p = owner.get_parameter(name)
                part = DTensor.from_local(g, owner.stage_mesh, dtensor_placements(self.layouts[name]), run_check=False)
                p.grad = part if p.grad is None else p.grad + part

        return run


@dataclass(frozen=True)
class StageCheck:
    """``parallelize(..., verify=True)`` on a pipeline: the first ``step`` runs each held stage's
    ``recording`` program (``lower(..., record=True)``), then every rank compares the values its
    stages computed for the first microbatch with the whole program ``graph`` (before the split)
    run on whole tensors, and all raise the earliest difference alike (``Verifier.check_stages``).
    ``rank``: this rank's place on the stage mesh."""

    graph: ir.Graph
    rank: RankContext
    recording: Mapping[int, Lowered]


def local_zeros(v: ir.Value, graph: ir.Graph, mesh: DeviceMesh) -> torch.Tensor:
    """Zeros of this rank's shard of ``v``."""
    t = v.type
    assert isinstance(t, ir.TensorType)
    shape = v.layout.local_shape(t.shape, graph.mesh, mesh.get_coordinate()) if graph.mesh is not None else t.shape
    return torch.zeros(tuple(int(d) for d in shape), dtype=t.dtype)


def examples(graph: ir.Graph, mesh: DeviceMesh, kind: str) -> tuple[torch.Tensor, ...]:
    """Empty tensors of the local shapes of ``graph``'s boundary input (``input`` kind, not a user
    input) or its outputs (``out``)."""
    coord = mesh.get_coordinate()
    if kind == "input":
        values = [i.value for i in graph.inputs if i.kind == "input"][-1:]  # NOTE: after the user inputs
    else:
        values = [o.value for o in graph.outputs if o.kind == "out"]
    out = []
    for v in values:
        t = v.type
        assert isinstance(t, ir.TensorType)
        shape = v.layout.local_shape(t.shape, graph.mesh, coord) if graph.mesh is not None else t.shape
        # NOTE: the activations a stage sends and receives carry gradients back: their examples say so
        # (what the schedule then prepares its buffers by, with no trial run of the stage)
        out.append(torch.empty(tuple(int(d) for d in shape), dtype=t.dtype, requires_grad=t.dtype.is_floating_point))
    return tuple(out)


def stage_lowering(
    graph: ir.Graph, spec: PipelineSpec, rank: RankContext, rng: torch.Generator, *, record: bool = False
) -> Lowered:
    """A stage's lowered program; under ``zero-bubble`` its backward in two (its input's gradient,
    which the stage before waits for, then its weights'). ``record``: as ``lower``'s."""
    if spec.schedule != "zero-bubble":
        return lower(graph, rank, rng=rng, record=record)
    received = [i.name for i in graph.inputs if i.kind == "input" and any(o.name == i.name for o in graph.outputs)]
    return lower_split(graph, rank, received[0] if received else "", rng, record=record)
