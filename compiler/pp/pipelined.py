"""Pipeline parallelism on ranks: each stage's program run by ``torch.distributed.pipelining``.

``parallelize(model, mesh, inputs, plan="pp+fsdp", pp={...})`` on a mesh with a ``pp`` axis compiles
the model once for one microbatch on the other axes (``dp``/``tp``/... as the rest of the plan says),
splits the program into ``pp * virtual`` stages at its layer stack (``meshfold.pp.stage_split``) and gives
rank ``r`` of the ``pp`` axis stages ``r, r + pp, ...`` (one each under ``gpipe`` and ``1f1b``;
``virtual`` of them, looping, under ``interleaved``). Each stage is a ``PipelineStage`` whose module
runs the stage's forward program under autograd and its backward program as the backward; the
library's schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``) sends the hidden
states and their gradients between the stages.

``pm.step(*inputs)`` takes the whole batch, splits it into ``microbatches`` along dim 0, runs the
schedule and returns the mean of the microbatches' losses on every rank; each parameter's gradient
is the mean of the microbatches' (the schedule scales the sum), so a loss that averages over equal
microbatches (the mean cross-entropy of sequences without ignored labels, a mean-squared error) gets
the gradient of the whole batch. A rank holds the parameters of its own stages only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from meshfold import ir
from meshfold.backends.eager import Lowered
from meshfold.passes.base import PassError
from meshfold.passes.stages import PP, PipelineSpec
from meshfold.pp.stage_module import StageCheck, StageModule, StepTime, examples
from meshfold.pp.stage_plan import PipelinePlan
from meshfold.rewrites.moe_lists import stack_tensors
from meshfold.runtime.crosscheck import Verifier
from meshfold.runtime.groups import dtensor_placements
from meshfold.runtime.parallel_module import parent_of
from meshfold.runtime.signature import Signature, agree

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
}


def microbatch(inputs: Sequence[Any], spec: PipelineSpec) -> list[Any]:
    """The first microbatch of ``inputs`` (what the program is compiled for); raises when dim 0 of a
    tensor input does not split into ``spec.microbatches`` equal parts."""
    out = []
    for k, x in enumerate(inputs):
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 or x.shape[0] % spec.microbatches:
                raise PassError(
                    f"pp: input {k} has shape {tuple(x.shape)}; a step splits dim 0 into {spec.microbatches} "
                    "equal microbatches: give a batch they divide (or another microbatches=)"
                )
            x = x[: x.shape[0] // spec.microbatches]
        out.append(x)
    return out


def stage_mesh(mesh: DeviceMesh, others: ir.Mesh) -> tuple[DeviceMesh, DeviceMesh]:
    """``mesh`` (with a ``pp`` axis) and the mesh of ``others``, its other axes (``Options.mesh``,
    which the options' reader made once), that each stage's program runs on; a mesh of ``pp`` alone
    is given the ``dp`` axis of one rank its ``others`` name."""
    names = list(mesh.mesh_dim_names or ())
    if PP not in names:
        raise PassError(f"pipeline parallelism needs a mesh axis named {PP!r}; the mesh has {names}")
    if not set(others.names) <= set(names):
        mesh = init_device_mesh(mesh.device_type, (mesh.size(), *others.sizes), mesh_dim_names=(PP, *others.names))
    return mesh, mesh[others.names]


class PipelinedModule(nn.Module):
    """The model on one rank of a pipeline: the parameters of its stages, and ``step``."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        sub: DeviceMesh,
        plan: PipelinePlan,
        stages: Mapping[int, tuple[ir.Graph, Lowered]],
        input_names: Sequence[str],
        tied: Mapping[str, tuple[int, ...]],
        report: Sequence[str] = (),
        check: StageCheck | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan
        """The pipeline's schedule, split and predicted step (``meshfold.pp.stage_split.PipelinePlan``)."""
        spec = self.spec = plan.spec
        self.split = plan.split
        self.stage_mesh = sub
        self._mesh = mesh
        self._group = _pipeline_group(mesh, spec)
        self._input_names = tuple(input_names)
        self._report = tuple(report)
        self._stage_graphs = {s: g for s, (g, _) in stages.items()}
        state = dict(model.named_parameters()) | dict(model.named_buffers())
        # NOTE: experts folded from an nn.ModuleList run on stacked parameters built from the model's own
        stacks = {st.name: st for graph, _ in stages.values() for st in graph.stacks}
        with torch.no_grad():
            stacked = stack_tensors(tuple(stacks.values()), state)
        state |= {n: t.requires_grad_(True) for n, t in stacked.items()}
        self._check = check
        # NOTE: verification compares against the single-device model as it was handed to us
        self._reference = {n: t.detach().clone() for n, t in state.items()} if check is not None else {}
        for graph, low in stages.values():
            layouts = {i.name: i.value.layout for i in graph.inputs}
            kinds = {i.name: i.kind for i in graph.inputs}
            for name in low.fwd_inputs:
                if kinds[name] not in ("param", "buffer") or _has(self, name):
                    continue
                src = state[name].detach().clone()
                dt = distribute_tensor(src, sub, dtensor_placements(layouts[name]), src_data_rank=None)
                parent, leaf = parent_of(self, name)
                if kinds[name] == "param":
                    parent.register_parameter(leaf, nn.Parameter(dt, requires_grad=state[name].requires_grad))
                else:
                    parent.register_buffer(leaf, dt)
        taken: set[str] = set()
        self._modules_ = {s: StageModule(self, g, low, taken) for s, (g, low) in sorted(stages.items())}
        self._tied = _tied_groups(mesh, spec, tied, set(taken))
        device = (
            torch.device("cpu")
            if mesh.device_type == "cpu"
            else torch.device(mesh.device_type, torch.cuda.current_device())
        )
        self._pipeline_stages = [
            PipelineStage(
                self._modules_[s],
                s,
                spec.stages,
                device,
                input_args=examples(self._stage_graphs[s], sub, "input") if s > 0 else (),
                output_args=examples(self._stage_graphs[s], sub, "out"),
                group=self._group,
                dw_builder=self._modules_[s].weight_step if self._modules_[s].low.weights is not None else None,
            )
            for s in sorted(stages)
        ]
        kind = SCHEDULES[spec.schedule]
        loss = _own_loss
        if spec.schedule in ("interleaved", "zero-bubble"):
            self._schedule: Any = kind(self._pipeline_stages, spec.microbatches, loss_fn=loss)
        else:
            (stage,) = self._pipeline_stages
            self._schedule = kind(stage, spec.microbatches, loss_fn=loss)
        self._last_rank = dist.get_global_rank(self._group, (spec.stages - 1) % spec.ranks)
        self._sig: Signature | None = None
        self.last_step = StepTime()
        """The last ``step``'s wall time and the time this rank's programs ran in it."""

    def forward(self, *inputs: Any) -> Any:
        raise PassError(
            "a pipelined module runs forward and backward together, microbatch by microbatch: call "
            "pm.step(*inputs) (it returns the loss; the gradients are then in the parameters' .grad)"
        )

    def step(self, *inputs: Any) -> torch.Tensor:
        """One training step's forward and backward on the whole batch ``inputs`` (split into the
        spec's microbatches); returns the loss (the microbatches' mean) on every rank."""
        sig = Signature.of(inputs, self.training)
        if self._sig is None:
            self._sig = sig
        problem = None
        if sig != self._sig:
            problem = "the inputs' shapes or dtypes differ from the first step's (a pipelined module runs those)"
        problem = problem or uneven_ignored(inputs, self._input_names, self.spec.microbatches)
        agree(sig, problem, self._input_names)
        if problem:
            raise PassError(f"pp: {problem}")
        kwargs = {
            n: x for n, x in zip(self._input_names, [x for x in inputs if isinstance(x, torch.Tensor)], strict=True)
        }
        losses: list[torch.Tensor] = []
        target = torch.zeros(self.spec.microbatches)
        self.last_step = StepTime()
        check, self._check = self._check, None
        plain = {s: st.low for s, st in self._modules_.items()}
        for s, st in self._modules_.items():
            st.forwards = 0
            st.recorded.clear()
            if check is not None:  # NOTE: the first step runs the recording programs, checked once
                st.low = check.recording[s]
        start = time.perf_counter()
        try:
            self._schedule.step(target=target, losses=losses, return_outputs=False, **kwargs)
        finally:
            for s, st in self._modules_.items():
                st.low = plain[s]
        self.last_step.seconds = time.perf_counter() - start
        if check is not None:
            self._verify(check, inputs)
        for name, group in self._tied:  # NOTE: each holder of a tied weight adds the others' parts
            grad = self.get_parameter(name).grad
            if grad is not None:
                dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)
        loss = torch.stack([x.detach() for x in losses]).mean() if losses else torch.zeros(())
        dist.broadcast(loss, self._last_rank, group=self._group)
        return loss

    def _verify(self, check: StageCheck, inputs: Sequence[Any]) -> None:
        """Check what this rank's stages computed for the first microbatch (``StageCheck``)."""
        first = [x for x in microbatch(inputs, self.spec) if isinstance(x, torch.Tensor)]
        feeds = self._reference | dict(zip(self._input_names, first, strict=True))
        verifier = Verifier(check.graph, self.stage_mesh, check.rank, feeds)
        verifier.check_stages([r for st in self._modules_.values() for r in st.recorded])
        for st in self._modules_.values():
            st.recorded.clear()

    def close(self) -> None:
        """Destroy the process groups this module made (its pipeline's, its tied weights'); the module
        cannot step afterwards. Collective: every rank closes its module."""
        for group in dict.fromkeys([self._group, *(g for _, g in self._tied)]):
            dist.destroy_process_group(group)

    def stage_graph(self, stage: int) -> ir.Graph:
        """The program of ``stage`` (one this rank runs)."""
        return self._stage_graphs[stage]

    def stages(self) -> list[int]:
        """The stages this rank runs."""
        return sorted(self._stage_graphs)

    @property
    def mesh(self) -> DeviceMesh:
        """The whole ``DeviceMesh``, ``pp`` axis included (the one ``parallelize`` built for a world size)."""
        return self._mesh

    def plan_report(self) -> list[str]:
        return list(self._report)


def _by_stage(mesh: DeviceMesh, spec: PipelineSpec) -> torch.Tensor:
    """The mesh's global ranks as ``[pp rank, coordinate of the other axes]``."""
    names = list(mesh.mesh_dim_names or ())
    return mesh.mesh.movedim(names.index(PP), 0).reshape(spec.ranks, -1)


def _pipeline_group(mesh: DeviceMesh, spec: PipelineSpec) -> dist.ProcessGroup:
    """This rank's pipeline: the ranks of its coordinate on the other axes, one per pp rank, in a
    group of the module's own (the stages' sends and receives count on no group the mesh's
    collectives use). Collective: every rank makes every pipeline's group."""
    ranks = _by_stage(mesh, spec)
    group, _ = dist.new_subgroups_by_enumeration(
        [[int(ranks[r, c]) for r in range(spec.ranks)] for c in range(ranks.shape[1])]
    )
    assert group is not None
    return group


IGNORE_INDEX = -100
"""The label cross-entropy skips by default (``torch.nn.functional.cross_entropy``, transformers)."""


def uneven_ignored(inputs: Sequence[Any], names: Sequence[str], microbatches: int) -> str | None:
    """Why averaging the microbatches' losses would not give the batch's, if an integer input holds
    ignored labels (``IGNORE_INDEX``) unevenly: a loss that averages over the counted labels then
    weighs each microbatch by its own count, the whole batch by the total."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    for name, x in zip(names, tensors, strict=False):
        if x.is_floating_point() or x.dim() == 0 or not bool((x == IGNORE_INDEX).any()):
            continue
        counts = [int((part != IGNORE_INDEX).sum()) for part in x.chunk(microbatches)]
        if len(set(counts)) > 1:
            return (
                f"input {name!r} holds ignored labels ({IGNORE_INDEX}) unevenly over the {microbatches} microbatches "
                f"(counted labels per microbatch: {counts}); the mean of their mean losses is not the batch's. "
                "Give each microbatch as many counted labels, or a loss summed over tokens"
            )
    return None


def _tied_groups(
    mesh: DeviceMesh, spec: PipelineSpec, tied: Mapping[str, tuple[int, ...]], held: set[str]
) -> list[tuple[str, dist.ProcessGroup]]:
    """For each tied weight held by several pipeline ranks, the group of those ranks (one per
    coordinate of the other axes) this rank is in, if it holds the weight. Collective: every rank
    makes every group, in one order."""
    ranks = _by_stage(mesh, spec)
    out = []
    made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for name in sorted(tied):
        holders = tuple(sorted({s % spec.ranks for s in tied[name]}))
        if len(holders) < 2:
            continue
        if holders not in made:
            rows = [[int(ranks[r, c]) for r in holders] for c in range(ranks.shape[1])]
            made[holders], _ = dist.new_subgroups_by_enumeration(rows)
        group = made[holders]
        if name in held and group is not None:
            out.append((name, group))
    return out


def _own_loss(output: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    """The model computes its loss itself: the last stage's output is it (the target is unused)."""
    return output


def _has(module: nn.Module, fqn: str) -> bool:
    try:
        module.get_parameter(fqn)
        return True
    except AttributeError:
        try:
            module.get_buffer(fqn)
            return True
        except AttributeError:
            return False
