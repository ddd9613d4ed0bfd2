"""``ParallelModule``: runs one rank's lowered program under one ``autograd.Function``.

Parameters are ``DTensor``s on the user's ``DeviceMesh`` under the model's own FQNs, so
``torch.optim``, ``clip_grad_norm_`` and ``torch.distributed.checkpoint`` work unchanged. (Experts
folded from an ``nn.ModuleList`` are the exception: they are one stacked parameter per list and
projection, ``<list>.gate_up_proj`` and ``<list>.down_proj``; ``model_state_dict`` gives them back
under the model's FQNs.) The
forward module returns the model's outputs plus the values the backward needs; the backward
module returns each parameter's local gradient already in the parameter's own layout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.utils._pytree import tree_unflatten

from meshfold import ir
from meshfold.backends.eager import Lowered
from meshfold.passes.options import DEFAULT_CACHE
from meshfold.rewrites.moe_lists import as_unstacked, stack_tensors
from meshfold.runtime.checkpoint import Checkpointer, resume
from meshfold.runtime.crosscheck import Verifier
from meshfold.runtime.groups import dtensor_placements
from meshfold.runtime.programs import Compiler, Program, Programs
from meshfold.runtime.signature import Signature, agree, arg_names, autocast_off, collective_device
from meshfold.tracing.tracer import output_structure


class _Step(torch.autograd.Function):
    """Forward and backward of the whole model on this rank's shards."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, runner: ParallelModule, program: Program, low: Lowered, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        with autocast_off():  # NOTE: a program compiled under autocast holds its casts as ops
            outs = low.forward(*tensors)
        k = len(low.fwd_outputs)
        end = k + low.n_saved
        if runner._mf_verifier is not None:
            runner._mf_verifier.check(low.fwd_recorded, outs[end:], "forward")
        ctx.runner = runner
        ctx.program = program
        ctx.low = low
        # NOTE: an output nobody called backward through gets None here, not zeros: that is how
        # ``backward`` tells which parameters the user's backward reaches (``grad_sources``).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*outs[k:end])
        results = tuple(outs[:k])
        ctx.mark_non_differentiable(
            *[r for r, (kind, _) in zip(results, low.fwd_outputs, strict=True) if kind != "out"]
        )
        ctx.out_meta = [(r.shape, r.dtype) for r in results]
        return results

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        runner: ParallelModule = ctx.runner
        low: Lowered = ctx.low
        by_out = {name: i for i, (kind, name) in enumerate(low.fwd_outputs) if kind == "out"}
        tangents = []
        reached: set[str] = set()
        for t in low.bwd_inputs:
            i = by_out[t.split(".", 1)[1]]
            g = grads[i]
            shape, dtype = ctx.out_meta[i]
            if g is not None:
                reached.add(t)
            tangents.append(g if g is not None else torch.zeros(shape, dtype=dtype))
        with autocast_off():
            outs = low.backward(*ctx.saved_tensors, *tangents)
        n = len(low.bwd_outputs)
        verifier = runner._mf_verifier
        if verifier is not None:
            runner._mf_verifier = None
            if all(bool((t == 1).all()) for t in tangents):
                verifier.check(low.bwd_recorded, outs[n:], "backward")
        by_name = dict(zip(low.bwd_outputs, outs[:n], strict=True))
        # NOTE: every rank runs the whole backward program (its collectives included) and then drops
        # the gradients no differentiated output reaches, so ``.grad`` stays None as on one device.
        sources = ctx.program.grad_sources
        return (
            None,
            None,
            None,
            *[by_name.get(n) if sources.get(n, set()) & reached else None for n in low.fwd_inputs],
        )


class ParallelModule(nn.Module):
    """The compiled model on one rank. Call it like the original model."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        first: Program,
        compiler: Compiler,
        cache_size: int = DEFAULT_CACHE,
        *,
        shapes: nn.Module | None = None,
        rng: torch.Generator | None = None,
        world: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__()
        graph = first.graph
        self._mf_programs = Programs(first, compiler, cache_size, arg_names(model))
        self.train(model.training)
        self._mf_verifier: Verifier | None = None
        self._mf_mesh = mesh
        self._mf_rng = rng
        self._mf_timeout = timeout
        self._mf_checkpointer: Checkpointer | None = None
        self._mf_world = world if world is not None else dist.group.WORLD
        # NOTE: ``shapes`` (the model, or a copy without weights) learns each program's output
        # structure: ``output_structure`` runs it on fake tensors.
        self._mf_structure_of = (shapes if shapes is not None else model,)  # NOTE: a tuple: not a submodule
        state = dict(model.named_parameters()) | dict(model.named_buffers())
        self._mf_state_keys = _state_dict_names(model)
        # NOTE: a model's non-persistent buffers (rotary tables) stay out of every state dict, ours too.
        non_persistent = _non_persistent_buffers(model)
        stacked_members = {m for st in graph.stacks for row in st.members for m in row}
        # NOTE: experts folded from an nn.ModuleList run on stacked parameters built from the model's own.
        with torch.no_grad():
            stacked = stack_tensors(graph.stacks, state)
        state |= {n: t.requires_grad_(True) for n, t in stacked.items()}
        # NOTE: verification compares against the single-device model as it was handed to us.
        self._mf_reference_state = {n: t.detach().clone() for n, t in state.items()} if first.verify_with else {}
        layouts = first.state_layouts()
        for name in first.lowered.fwd_inputs:
            kind = first.kinds[name]
            if kind not in ("param", "buffer"):
                continue
            src = state[name].detach().clone()  # NOTE: never alias the user's tensors
            dt = distribute_tensor(src, mesh, dtensor_placements(layouts[name]), src_data_rank=None)
            parent, leaf = self._mf_parent(name)
            if kind == "param":
                parent.register_parameter(leaf, nn.Parameter(dt, requires_grad=state[name].requires_grad))
            else:
                parent.register_buffer(leaf, dt, persistent=name not in non_persistent)
        self._mf_register_rest(state, stacked_members, {n for n, _ in model.named_parameters()})

    def _mf_register_rest(self, state: dict[str, torch.Tensor], stacked_members: set[str], params: set[str]) -> None:
        """Give every key of the model's state dict a tensor here, so ``state_dict()`` and
        ``torch.distributed.checkpoint.state_dict`` see exactly the model's keys.

        NOTE: what the graph never reads (an unused parameter) is registered replicated and never gets
        a gradient, as on one device; a tied weight's second name is the same ``Parameter`` again."""
        for key, name in self._mf_state_keys.items():
            if name in stacked_members:
                continue
            parent, leaf = self._mf_parent(name)
            if not hasattr(parent, leaf):
                src = state[name].detach().clone()
                dt = distribute_tensor(src, self._mf_mesh, [Replicate()] * self._mf_mesh.ndim, src_data_rank=None)
                if name in params:
                    parent.register_parameter(leaf, nn.Parameter(dt, requires_grad=state[name].requires_grad))
                else:
                    parent.register_buffer(leaf, dt)
            if key != name:
                alias_parent, alias_leaf = self._mf_parent(key)
                t = getattr(parent, leaf)
                if isinstance(t, nn.Parameter):
                    alias_parent.register_parameter(alias_leaf, t)
                else:
                    alias_parent.register_buffer(alias_leaf, t)

    def _mf_parent(self, fqn: str) -> tuple[nn.Module, str]:
        return parent_of(self, fqn)

    def _mf_tensor(self, fqn: str) -> torch.Tensor:
        parent, leaf = self._mf_parent(fqn)
        t = getattr(parent, leaf)
        assert isinstance(t, torch.Tensor)
        return t

    def _mf_start_verification(self, program: Program, inputs: Sequence[Any]) -> None:
        assert program.verify_with is not None
        low, rank = program.verify_with
        feeds: dict[str, torch.Tensor] = {}
        user = iter(x for x in inputs if isinstance(x, torch.Tensor))
        for name in low.fwd_inputs:
            if program.kinds[name] in ("param", "buffer"):
                feeds[name] = self._mf_reference_state[name]
            else:
                feeds[name] = next(user)
        self._mf_verifier = Verifier(program.graph, self._mf_mesh, rank, feeds)

    def forward(self, *inputs: Any) -> Any:
        sig = Signature.of(inputs, self.training)
        # NOTE: before any collective of a program, so a differing rank never leaves the others waiting
        agree(sig, _needs_input_grad(inputs, sig, self._mf_programs.names), self._mf_programs.names, self._mf_world)
        program = self._mf_programs.get(inputs, sig)
        self._mf_verifier = None
        low = program.lowered
        if program.verify_with is not None:
            # NOTE: the first step runs the recording module, checked value by value (once)
            self._mf_start_verification(program, inputs)
            low = program.verify_with[0]
            program.verify_with = None
        user = iter(x for x in inputs if isinstance(x, torch.Tensor))
        tensors: list[torch.Tensor] = []
        for name, layout in zip(low.fwd_inputs, program.input_layouts, strict=True):
            if program.kinds[name] in ("param", "buffer"):
                t = self._mf_tensor(name)
                tensors.append(t.to_local() if isinstance(t, DTensor) else t)
            else:
                x = next(user)
                dt = distribute_tensor(x, self._mf_mesh, dtensor_placements(layout), src_data_rank=None)
                tensors.append(dt.to_local())
        # NOTE: a forward-only program (no grad) runs outside autograd: nothing is saved, no backward exists
        if sig.grad:
            results = _Step.apply(self, program, low, *tensors)
        else:
            with autocast_off():
                results = low.forward(*tensors)
        outs: list[torch.Tensor] = []
        with torch.no_grad():
            for r, (kind, name) in zip(results, low.fwd_outputs, strict=True):
                if kind == "update":
                    buf = self._mf_tensor(name)
                    (buf.to_local() if isinstance(buf, DTensor) else buf).copy_(r)
                else:
                    outs.append(r)
        return self._mf_assemble(program, inputs, outs, [name for kind, name in low.fwd_outputs if kind != "update"])

    def _mf_assemble(self, program: Program, inputs: Sequence[Any], outs: list[torch.Tensor], names: list[str]) -> Any:
        """The model's own output: its pytree structure, tensor leaf ``i`` the graph output ``out(i)``,
        the other leaves the values the model returned when compiled (see ``output_structure``)."""
        if not program.structure_known:
            program.structure_known = True
            model = self._mf_structure_of[0]
            was = model.training
            try:
                model.train(program.signature.training)
                with torch.set_grad_enabled(program.signature.grad):
                    program.structure = output_structure(model, inputs)
            except Exception:
                # NOTE: a forward that fake tensors cannot run again: keep the flat outputs.
                program.structure = None
            finally:
                model.train(was)
            if program.structure is not None:
                tensor_leaves = {str(i) for i, x in enumerate(program.structure[1]) if x is None}
                if tensor_leaves != set(names):
                    program.structure = None
        if program.structure is None:
            return tuple(outs) if program.output_is_tuple or len(outs) != 1 else outs[0]
        spec, leaves = program.structure
        by_index = dict(zip(names, outs, strict=True))
        return tree_unflatten([by_index[str(i)] if x is None else x for i, x in enumerate(leaves)], spec)

    def graph(self) -> ir.Graph:
        """The SPMD graph (layouts and collectives) compiled for the example inputs, for inspection."""
        return self._mf_programs.first.graph

    @property
    def mesh(self) -> DeviceMesh:
        """The ``DeviceMesh`` the module runs on (the one ``parallelize`` built for a world size)."""
        return self._mf_mesh

    def plan_report(self) -> list[str]:
        """How the sharding solve went for the example inputs' program: per mesh axis its program
        size, whether HiGHS proved the plan optimal or stopped at the node limit, and the gap; then
        the modelled step time beside the mesh's preset's; then, under a ``memory=`` policy or budget,
        what the memory pass recomputed or offloaded, the time that adds and the predicted peak per
        rank. Empty for a plan that solved nothing and kept every activation."""
        return list(self._mf_programs.first.report)

    def export_onnx(self, directory: str | os.PathLike[str]) -> Path:
        """Write this rank's forward program for the example inputs as the ONNX model
        ``directory/rank{R}.onnx`` (R: the world rank) and return its path: this rank's shards as
        initializers, its pieces of the inputs and outputs as the graph's, collectives as ops of the
        ``meshfold`` domain (``meshfold.backends.onnx``). Needs the ``onnx`` extra. Each rank writes
        its own file; nothing is exchanged. Raises, naming the op, where the program calls what the
        exporter cannot take."""
        from meshfold.runtime.onnx_export import export_onnx

        return export_onnx(self, directory)

    def manual_seed(self, seed: int) -> None:
        """Seed the generator every random op of this module's programs draws from (dropout masks).
        Collective: call it on every rank with the same seed (a differing seed raises on every rank)."""
        flags = torch.tensor([seed, -seed], dtype=torch.int64, device=collective_device(self._mf_world))
        got = funcol.all_reduce(flags, "max", self._mf_world).tolist()
        if int(got[0]) != -int(got[1]):
            raise ValueError(
                f"manual_seed: the ranks gave different seeds ({-int(got[1])} to {int(got[0])}); give one seed"
            )
        if self._mf_rng is not None:
            self._mf_rng.manual_seed(seed)

    def checkpoint(
        self,
        root: str | os.PathLike[str],
        step: int,
        optimizer: torch.optim.Optimizer | None = None,
        state: dict[str, torch.Tensor] | None = None,
    ) -> Future[Any]:
        """Write ``root/step-{step:08d}`` asynchronously: this module's shards, ``optimizer``'s state,
        the random generators and ``state``'s tensors (a data position). Returns once they are copied
        to host memory; the future resolves when the write is done, and only then is the checkpoint
        marked complete (``meshfold.runtime.checkpoint``). Collective: every rank, the same step."""
        if self._mf_checkpointer is None:
            self._mf_checkpointer = Checkpointer(self._mf_timeout)
        return self._mf_checkpointer.save(self, root, step, optimizer, state)

    def wait_checkpoint(self) -> None:
        """Block until the checkpoint in flight (if any) is written; raises what its write raised."""
        if self._mf_checkpointer is not None:
            self._mf_checkpointer.wait()

    def resume(
        self,
        root: str | os.PathLike[str],
        optimizer: torch.optim.Optimizer | None = None,
        state: dict[str, torch.Tensor] | None = None,
    ) -> int | None:
        """Load the newest complete checkpoint under ``root`` (written under any plan and world size)
        into this module, ``optimizer`` and ``state``'s tensors, and restore the random generators;
        return the step it was taken at, or None when there is none. Collective: every rank."""
        saved = resume(self, root, optimizer, state)
        return None if saved is None else saved.step

    def programs(self) -> list[tuple[str, int]]:
        """Every program this module holds, as (signature, calls), least recently used first; a
        signature that could not be compiled shows -1 calls. See ``parallelize(..., cache_size=)``."""
        return self._mf_programs.report()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device model's ``state_dict()``, whole (gathered): the same keys in the same order
        (persistent buffers only; both names of a tied weight), so ``model.load_state_dict(...,
        strict=True)`` takes it. Stacked experts are cut back into the model's per-expert weights.
        Collective: call it on every rank."""
        whole = {
            n: t.full_tensor() if isinstance(t, DTensor) else t
            for n, t in [*self.named_parameters(), *self.named_buffers()]
        }
        own = as_unstacked(self._mf_programs.first.graph.stacks, whole)
        return {key: own[name].detach() for key, name in self._mf_state_keys.items()}


def parent_of(module: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """The module that holds (or will hold) ``fqn`` under ``module``, made empty where missing, and
    the tensor's own name in it."""
    *path, leaf = fqn.split(".")
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module, leaf


def _needs_input_grad(inputs: Sequence[Any], sig: Signature, names: Sequence[str]) -> str | None:
    """Why the call cannot run when autograd would want a gradient of an input (not computed yet)."""
    if not sig.grad:
        return None
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            name = names[i] if i < len(names) else f"arg{i}"
            return (
                f"input {name!r} requires grad; a compiled module computes gradients of the model's parameters, "
                "not of its inputs: pass it detached (x.detach()), or run that part of the model outside parallelize"
            )
    return None


def _state_dict_names(model: nn.Module) -> dict[str, str]:
    """Each key of ``model.state_dict()`` → the name ``named_parameters``/``named_buffers`` give that
    tensor (they list a tied weight once, the state dict under every name)."""
    first: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        first.setdefault(id(t), name)
    return {key: first[id(t)] for key, t in model.state_dict(keep_vars=True).items() if id(t) in first}


def _non_persistent_buffers(model: nn.Module) -> set[str]:
    """FQNs of the buffers ``model`` registered with ``persistent=False``."""
    return {
        f"{path}.{leaf}" if path else leaf
        for path, mod in model.named_modules(remove_duplicate=False)
        for leaf in mod._non_persistent_buffers_set
    }


def named_placements(pm: ParallelModule) -> Sequence[tuple[str, str]]:
    """(FQN, layout text) for every parameter, for plan summaries."""
    return [(i.name, str(i.value.layout)) for i in pm.graph().inputs if i.kind == "param"]
