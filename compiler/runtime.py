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

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_unflatten

from meshfold import ir
from meshfold.backends.eager import Lowered, RankContext
from meshfold.moe_lists import as_unstacked, stack_tensors
from meshfold.signature import CallSpec, agree
from meshfold.tracer import output_structure
from meshfold.verify import Verifier


def dtensor_placements(layout: ir.Layout) -> list[Any]:
    """Our placements as DTensor's (same order: one per mesh dim)."""
    out: list[Any] = []
    for p in layout.placements:
        if isinstance(p, ir.Shard):
            out.append(Shard(p.dim))
        elif isinstance(p, ir.Partial):
            out.append(Partial(p.reduce))
        else:
            out.append(Replicate())
    return out


class _Step(torch.autograd.Function):
    """Forward and backward of the whole model on this rank's shards."""

    @staticmethod
    def forward(ctx: Any, runner: ParallelModule, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        low = runner._mf_active()
        outs = low.forward(*tensors)
        k = len(low.fwd_outputs)
        end = k + low.n_saved
        if runner._mf_verifier is not None:
            runner._mf_verifier.check(low.fwd_recorded, outs[end:], "forward")
        ctx.runner = runner
        ctx.low = low
        # NOTE: an output nobody called backward through gets None here, not zeros: that is how
        # ``backward`` tells which parameters the user's backward reaches (``_grad_sources``).
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
        sources = runner._mf_grad_sources
        return (None, *[by_name.get(n) if sources.get(n, set()) & reached else None for n in low.fwd_inputs])


class ParallelModule(nn.Module):
    """The compiled model on one rank. Call it like the original model."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        graph: ir.Graph,
        lowered: Lowered,
        output_is_tuple: bool,
        verify_with: tuple[Lowered, RankContext] | None = None,
    ) -> None:
        super().__init__()
        self._mf_graph = graph
        self._mf_call = CallSpec.of(graph, model.training)
        self.train(model.training)
        self._mf_lowered = lowered
        self._mf_verify_with = verify_with
        self._mf_verifier: Verifier | None = None
        self._mf_mesh = mesh
        self._mf_tuple = output_is_tuple
        self._mf_grad_sources = _grad_sources(graph)
        # NOTE: the model is kept only until the first call, which learns the output structure from it.
        self._mf_structure_of = [model]
        self._mf_outputs: tuple[Any, list[Any]] | None = None
        layouts = {i.name: i.value.layout for i in graph.inputs}
        self._mf_input_layouts = [layouts[n] for n in lowered.fwd_inputs]
        self._mf_kinds = {i.name: i.kind for i in graph.inputs}
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
        self._mf_reference_state = {n: t.detach().clone() for n, t in state.items()} if verify_with else {}
        for name in lowered.fwd_inputs:
            kind = self._mf_kinds[name]
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
        *path, leaf = fqn.split(".")
        mod: nn.Module = self
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = nn.Module()
                mod.add_module(part, child)
            mod = child
        return mod, leaf

    def _mf_tensor(self, fqn: str) -> torch.Tensor:
        parent, leaf = self._mf_parent(fqn)
        t = getattr(parent, leaf)
        assert isinstance(t, torch.Tensor)
        return t

    def _mf_active(self) -> Lowered:
        return self._mf_verify_with[0] if self._mf_verifier is not None and self._mf_verify_with else self._mf_lowered

    def _mf_start_verification(self, inputs: Sequence[Any]) -> None:
        assert self._mf_verify_with is not None
        low, rank = self._mf_verify_with
        feeds: dict[str, torch.Tensor] = {}
        user = iter(x for x in inputs if isinstance(x, torch.Tensor))
        for name in low.fwd_inputs:
            if self._mf_kinds[name] in ("param", "buffer"):
                feeds[name] = self._mf_reference_state[name]
            else:
                feeds[name] = next(user)
        self._mf_verifier = Verifier(self._mf_graph, self._mf_mesh, rank, feeds)

    def forward(self, *inputs: Any) -> Any:
        # NOTE: before any collective of the program, so a differing rank never leaves the others waiting
        agree(self._mf_call.mismatch(inputs, self.training))
        if self._mf_verify_with is not None:
            self._mf_start_verification(inputs)
        else:
            self._mf_verifier = None
        low = self._mf_active()
        user = iter(x for x in inputs if isinstance(x, torch.Tensor))
        tensors: list[torch.Tensor] = []
        for name, layout in zip(low.fwd_inputs, self._mf_input_layouts, strict=True):
            kind = self._mf_kinds[name]
            if kind in ("param", "buffer"):
                t = self._mf_tensor(name)
                tensors.append(t.to_local() if isinstance(t, DTensor) else t)
            else:
                x = next(user)
                dt = distribute_tensor(x, self._mf_mesh, dtensor_placements(layout), src_data_rank=None)
                tensors.append(dt.to_local())
        results = _Step.apply(self, *tensors)
        self._mf_verify_with = None
        outs: list[torch.Tensor] = []
        with torch.no_grad():
            for r, (kind, name) in zip(results, low.fwd_outputs, strict=True):
                if kind == "update":
                    buf = self._mf_tensor(name)
                    (buf.to_local() if isinstance(buf, DTensor) else buf).copy_(r)
                else:
                    outs.append(r)
        return self._mf_assemble(inputs, outs, [name for kind, name in low.fwd_outputs if kind != "update"])

    def _mf_assemble(self, inputs: Sequence[Any], outs: list[torch.Tensor], names: list[str]) -> Any:
        """The model's own output: its pytree structure, tensor leaf ``i`` the graph output ``out(i)``,
        the other leaves the values the model returned when compiled (see ``output_structure``)."""
        if self._mf_structure_of:
            model = self._mf_structure_of.pop()
            try:
                self._mf_outputs = output_structure(model, inputs)
            except Exception:
                # NOTE: a forward that fake tensors cannot run again: keep the flat outputs.
                self._mf_outputs = None
            if self._mf_outputs is not None:
                tensor_leaves = {str(i) for i, x in enumerate(self._mf_outputs[1]) if x is None}
                if tensor_leaves != set(names):
                    self._mf_outputs = None
        if self._mf_outputs is None:
            return tuple(outs) if self._mf_tuple or len(outs) != 1 else outs[0]
        spec, leaves = self._mf_outputs
        by_index = dict(zip(names, outs, strict=True))
        return tree_unflatten([by_index[str(i)] if x is None else x for i, x in enumerate(leaves)], spec)

    def graph(self) -> ir.Graph:
        """The compiled SPMD graph (layouts and collectives), for inspection and dumps."""
        return self._mf_graph

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device model's ``state_dict()``, whole (gathered): the same keys in the same order
        (persistent buffers only; both names of a tied weight), so ``model.load_state_dict(...,
        strict=True)`` takes it. Stacked experts are cut back into the model's per-expert weights.
        Collective: call it on every rank."""
        whole = {
            n: t.full_tensor() if isinstance(t, DTensor) else t
            for n, t in [*self.named_parameters(), *self.named_buffers()]
        }
        own = as_unstacked(self._mf_graph.stacks, whole)
        return {key: own[name].detach() for key, name in self._mf_state_keys.items()}


def _grad_sources(graph: ir.Graph) -> dict[str, set[str]]:
    """Each gradient output's name → the tangent inputs (``tangent.<i>``) it is computed from."""
    deps: dict[ir.Value, set[str]] = {i.value: {i.name} for i in graph.inputs if i.kind == "tangent"}

    def of(arg: Any) -> set[str]:
        if isinstance(arg, ir.Value):
            return deps.get(arg, set())
        if isinstance(arg, tuple):
            return set().union(*map(of, arg))
        return set()

    for op in graph.ops:
        found = of(op.args) | of(tuple(v for _, v in op.kwargs))
        if found:
            for r in op.results:
                deps[r] = found
    return {o.name: deps.get(o.value, set()) for o in graph.outputs if o.kind == "grad"}


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
