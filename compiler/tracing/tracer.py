"""Capture a single-device model as one joint forward+backward ``ir.Graph``.

Dynamo captures the model's forward, AOTAutograd traces the joint forward+backward ATen graph on
fake tensors (``aot_export_joint_with_descriptors``), and this module lifts that fx graph into the
IR: inputs and gradient outputs are named by the model's own FQNs, every op carries its module path,
phase and source line. No weight is allocated for a model on the meta device or in a fake mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import re
import warnings
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import unset_fake_temporarily

from meshfold import ir
from meshfold.ir import GraphBuilder, Provenance, Value, tensor_type
from meshfold.ir.dialects.constant import CONSTANT, literal
from meshfold.ir.types import type_of
from meshfold.passes.pipeline import long_lived_heap
from meshfold.passes.precision import Precision
from meshfold.rewrites.capture_passes import AfterCapturePass, CaptureState, capture_pipeline, run_capture_passes
from meshfold.rewrites.module_paths import module_path
from meshfold.tracing.capture_errors import (
    CaptureError,
    capture_error,
    in_place_parameter,
    retried_without_grad,
    source_line,
)
from meshfold.tracing.export_trace import dynamo_trace
from meshfold.tracing.fakes import cast_at_the_edges, fake_copies, guards_of
from meshfold.tracing.layer_runs import Run, find_runs, reduced
from meshfold.tracing.moe_layers import MoeSpec, experts_as_ops, op_options
from meshfold.tracing.unroll import Unfoldable, unroll

__all__ = ["CaptureError", "capture", "module_path", "output_structure", "sharding_decompositions"]


def sharding_decompositions() -> dict[Any, Any]:
    """ATen decompositions applied at capture: losses whose results depend on global sizes.

    ``nll_loss``/``mse_loss`` with ``reduction=mean`` divide by a count or a ``numel``; decomposed,
    that becomes an explicit sum divided by a counted total (or a constant from the global shape),
    which stays exact when the batch is sharded. ``log_softmax`` becomes max / exp / sum, which
    stays exact when the vocabulary is sharded.
    """
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    losses = [aten.mse_loss, aten.mse_loss_backward, aten.nll_loss_forward, aten.nll_loss_backward]
    # NOTE: log_softmax as amax / exp / sum: a vocab-sharded LM head's logits then need only two
    # small all-reduces (max and sum) instead of an all-gather of the logits.
    softmax = [aten._log_softmax, aten._log_softmax_backward_data]
    return dict(get_decompositions(losses + softmax))


def capture(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    name: str | None = None,
    decompose: bool = True,
    moe: MoeSpec | None = None,
    dynamic: Sequence[tuple[int, int]] = (),
    guards: list[sympy.Basic] | None = None,
    fold: bool = True,
    passes: str | None = None,
    after_pass: AfterCapturePass | None = None,
    precision: Precision | None = None,
) -> ir.Graph:
    """Capture ``model(*example_inputs)`` and its backward as one joint ``ir.Graph``.

    Inputs are ``param``/``buffer`` (model FQNs), ``input`` (the forward's argument names) and
    ``tangent`` (the seed gradient of each differentiable output); outputs are ``out(i)`` for the
    model's outputs, ``grad(fqn)`` for every parameter gradient and ``update(fqn)`` for the new
    value of every buffer the forward updates in place (e.g. running statistics). Runs on fake
    tensors. ``decompose`` applies :func:`sharding_decompositions` (numerically the same graph);
    written-out attention and causal convolutions are one op each (``meshfold.rewrites.fuse_attention``,
    ``fuse_conv``), a loop carrying a linear state one scan (``fold_scan``). MoE experts become
    ``meshfold.moe_experts`` ops with ``moe``'s capacity and dispatcher (``meshfold.tracing.moe_layers``); experts
    in an ``nn.ModuleList`` are one op on stacked parameters, in ``stacks`` (``meshfold.rewrites.moe_lists``).

    ``dynamic``: ``(input index, dim)`` pairs captured as symbolic sizes (a sequence length): shapes
    and shape arguments then hold sympy expressions of them, and ``guards`` (when given) receives
    the conditions on their values under which the graph is the model's (ranges, equalities).

    ``passes``: the capture passes run on dynamo's graph (``rewrites.capture_passes``; None: all of
    them, ``""``: none), ``after_pass(index, pass, text)`` called after each with the fx graph it left as
    text (once, for the trace that is kept).

    ``precision``: the floating parameters are captured in its ``param`` dtype, the forward's floating
    inputs and outputs cast as it says (``fakes.cast_at_the_edges``); the ``precision`` pass then
    makes the parameters fp32 master weights again (``meshfold.passes.precision``).

    ``fold``: runs of identical layers are traced once and the rest stamped (``meshfold.tracing.layer_runs``,
    ``meshfold.tracing.unroll``): the same graph as tracing every layer, in time that hardly grows with depth.
    """
    graph_name = name or _snake(type(model).__name__)
    rewrites = capture_pipeline(passes)
    param_dtype = None if precision is None else precision.param
    with (
        long_lived_heap(),
        fake_copies(model, example_inputs, dynamic, param_dtype) as (fake_mode, fake_inputs),
        experts_as_ops(model, moe),
        cast_at_the_edges(
            model,
            param_dtype if precision is not None and precision.cast_inputs else None,
            None if precision is None else precision.output,
        ),
    ):

        def traced(runs: list[Run]) -> ir.Graph:
            state = CaptureState(model, fake_mode, op_options(moe))
            shown: list[tuple[int, Any, str]] = []
            with reduced(model, runs):
                gm = _dynamo_capture(model, fake_inputs, static=not dynamic)
                keep = None if after_pass is None else lambda i, p, g: shown.append((i, p, str(g.graph)))
                run_capture_passes(rewrites, state, gm, keep)
                fqns = _flat_name_to_fqn(gm, model) | state.stacked
            with contextlib.ExitStack() as stack:
                with fake_mode:
                    try:
                        decomps = sharding_decompositions() if decompose else None
                        joint = aot_export_joint_with_descriptors(stack, gm, tuple(fake_inputs), decompositions=decomps)
                    except Exception as e:
                        raise capture_error(e, "tracing the backward") from e
                graph = _Lifter(graph_name, fqns, _forward_arg_names(model, len(fake_inputs))).lift(joint.graph_module)
            if guards is not None and dynamic:
                guards.extend(guards_of(fake_mode))
            out = _in_model_order(unroll(dataclasses.replace(graph, stacks=state.stacks), runs), model)
            for i, p, g in shown if after_pass is not None else ():
                after_pass(i, p, g)
            return out

        # NOTE: with symbolic sizes every layer is traced (the records compare concrete runs)
        runs = find_runs(model, fake_inputs) if fold and not dynamic else []
        try:
            return traced(runs)
        except Unfoldable:
            return traced([])


def output_structure(model: nn.Module, inputs: Sequence[Any]) -> tuple[Any, list[Any]]:
    """The pytree spec of ``model(*inputs)`` and its leaves, each tensor leaf replaced by ``None``.

    Runs the forward once on fake tensors (as :func:`capture` does, nothing is allocated). Leaf ``i``
    that is a tensor is the graph output ``out(i)``; the other leaves (strings, ints) are the values
    the model returned, constants of the compiled program like everything dynamo baked in.
    """
    with (
        warnings.catch_warnings(),
        fake_copies(model, inputs) as (fake_mode, fake_inputs),
        experts_as_ops(model),
        fake_mode,
        torch.no_grad(),
    ):
        warnings.simplefilter("ignore")
        leaves, spec = torch.utils._pytree.tree_flatten(model(*fake_inputs))
    return spec, [None if isinstance(x, torch.Tensor) else x for x in leaves]


def _in_model_order(graph: ir.Graph, model: nn.Module) -> ir.Graph:
    """Inputs ordered as the model declares them: parameters, buffers, user inputs, tangents (a
    stacked parameter where its first member is)."""
    rank = {f"param:{n}": i for i, (n, _) in enumerate(model.named_parameters())}
    rank |= {f"param:{s.name}": rank[f"param:{s.members[0][0]}"] for s in graph.stacks}
    rank |= {f"buffer:{n}": i for i, (n, _) in enumerate(model.named_buffers())}
    kinds = {k: i for i, k in enumerate(ir.graph.INPUT_KINDS)}
    order = sorted(graph.inputs, key=lambda i: (kinds[i.kind], rank.get(f"{i.kind}:{i.name}", len(rank))))
    return dataclasses.replace(graph, inputs=tuple(order))


def _flat_name_to_fqn(gm: fx.GraphModule, model: nn.Module) -> dict[str, str]:
    """Dynamo's flattened attribute names → the model's FQNs, by tensor identity (dynamo's own map
    misses tensors reached through loops over ``nn.ModuleList``)."""
    fqns: dict[str, str] = dict(gm.meta.get("dynamo_flat_name_to_original_fqn", {}))
    by_id: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        by_id.setdefault(id(t), name)
    for flat, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if id(t) in by_id:
            fqns[flat] = by_id[id(t)]
    return fqns


def _dynamo_capture(model: nn.Module, inputs: Sequence[Any], *, static: bool = False) -> fx.GraphModule:
    try:
        return dynamo_trace(model, inputs, static=static)
    except Exception as e:
        raise capture_error(e, "capturing the forward", mutated=lambda: _mutated_parameter(model, inputs)) from e


def _mutated_parameter(model: nn.Module, inputs: Sequence[Any]) -> str | None:
    """The FQN of the parameter the forward updates in place: dynamo refuses the update on a parameter
    that requires grad without saying which, so trace once more with none requiring grad and look."""
    try:
        gm = retried_without_grad(model, lambda: dynamo_trace(model, inputs))
    except Exception:
        # NOTE: only a diagnosis: when the retry fails too, the error names the line without the FQN.
        return None
    return in_place_parameter(gm, _flat_name_to_fqn(gm, model))


def _forward_arg_names(model: nn.Module, n: int) -> list[str]:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else f"arg{i}" for i in range(n)]


def _snake(name: str) -> str:
    """``GPT2Tiny`` → ``gpt2_tiny``, ``MLP`` → ``mlp``, ``LlamaForCausalLM`` → ``llama_for_causal_lm``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


class _Lifter:
    """Turns the joint fx graph into an ``ir.Graph``."""

    def __init__(self, name: str, fqns: dict[str, str], arg_names: list[str]) -> None:
        self.b = GraphBuilder(name)
        self.fqns = fqns
        self.arg_names = arg_names
        self.env: dict[fx.Node, Value | tuple[Value, ...]] = {}
        self.sizes: dict[fx.Node, Any] = {}
        self.backward: set[fx.Node] = set()

    def lift(self, gm: fx.GraphModule) -> ir.Graph:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "get_attr":
                self._constant(node, getattr(gm, str(node.target)))
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                self._outputs(node)
            else:
                raise CaptureError(f"unexpected fx node {node.format_node()} ({node.op}) in the joint graph")
        return self.b.build()

    def _fqn(self, target: str) -> str:
        return self.fqns.get(target, target)

    def _placeholder(self, node: fx.Node) -> None:
        desc = node.meta.get("desc")
        kind_name = type(desc).__name__
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            if not node.users:
                # NOTE: a Python scalar argument; dynamo baked its example value into the graph.
                return
            raise CaptureError(
                f"graph input {node.name} ({desc!r}) is a symbolic Python value ({type(val).__name__}); "
                "pass tensors, or plain Python values the model may treat as constants"
            )
        if kind_name in ("ParamAOTInput", "BufferAOTInput"):
            kind = "param" if kind_name == "ParamAOTInput" else "buffer"
            v = self.b.add_input(kind, self._fqn(desc.target), tensor_type(val))
        elif kind_name == "PlainAOTInput":
            v = self.b.add_input("input", self.arg_names[desc.idx], tensor_type(val))
        elif kind_name == "TangentAOTInput":
            self.backward.add(node)
            out_idx = getattr(desc.output, "idx", len([i for i in self.b._inputs if i.kind == "tangent"]))
            v = self.b.add_input("tangent", f"tangent.{out_idx}", tensor_type(val))
        else:
            raise CaptureError(f"unsupported graph input {node.name} described as {desc!r}")
        self.env[node] = v

    def _constant(self, node: fx.Node, value: object) -> None:
        """A tensor the forward made at trace time (a Python list used as an index, a scalar assigned
        into a slice): a ``meshfold.constant`` holding its values."""
        user = next(iter(node.users), node)
        if not isinstance(value, torch.Tensor):
            raise CaptureError(f"graph attribute {node.target} at {self._prov(user).describe()} is not a tensor")
        try:
            with unset_fake_temporarily():  # NOTE: a real tensor; read its values outside the capture's fake mode
                ints, floats, shape, dtype = literal(value)
        except ValueError as e:
            raise CaptureError(
                f"the model's forward makes a tensor constant at {self._prov(user).describe()}: {e}; register "
                "it as a buffer in the model's __init__ (self.register_buffer(name, tensor)) and use that"
            ) from None
        prov = dataclasses.replace(self._prov(user), phase="fwd")
        (v,) = self.b.add_op(CONSTANT, (ints, floats, shape, dtype), (), [(str(node.target), tensor_type(value))], prov)
        self.env[node] = v

    def _call(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            # NOTE: size arithmetic (``sym_size``, ``operator.mul`` of sizes) is no op of its own: its
            # value is a sympy expression of the inputs' symbolic sizes, used as the arguments it feeds
            expr = val.node.expr
            self.sizes[node] = int(expr) if expr.is_Integer else expr
            return
        if node.target is operator.getitem:
            src, idx = node.args
            if src in self.backward:
                self.backward.add(node)
            vals = self.env[src]  # type: ignore[index]
            if not isinstance(vals, tuple):
                raise CaptureError(f"getitem on a single-result op at {node.format_node()}")
            self.env[node] = vals[idx]  # type: ignore[index]
            return
        if not isinstance(node.target, torch._ops.OpOverload):
            raise CaptureError(
                f"op {node.target} at {self._prov(node).describe()} is not an ATen op overload; meshfold can't lift it "
                "(higher-order ops and Python callables in the joint graph are not supported yet)"
            )
        args = tuple(self._arg(a) for a in node.args)
        kwargs = tuple((k, self._arg(v)) for k, v in node.kwargs.items())
        outs = _flat_vals(node.meta.get("val"))
        results = [(_result_hint(node.name, i, len(outs)), type_of(o)) for i, o in enumerate(outs)]
        vals = self.b.add_op(node.target, args, kwargs, results, self._prov(node))
        is_multi = isinstance(node.meta.get("val"), (tuple, list))
        self.env[node] = vals if is_multi else vals[0]

    def _arg(self, a: Any) -> Any:
        if isinstance(a, fx.Node) and a in self.sizes:
            return self.sizes[a]
        if isinstance(a, fx.Node):
            v = self.env[a]
            if isinstance(v, tuple):
                raise CaptureError(f"multi-result node {a.name} used directly as an argument")
            return v
        if isinstance(a, (list, tuple)):
            return tuple(self._arg(x) for x in a)
        if isinstance(a, torch.SymInt):
            expr = a.node.expr
            return int(expr) if expr.is_Integer else expr
        return a

    def _prov(self, node: fx.Node) -> Provenance:
        # NOTE: AOT tags most backward nodes, but not all (e.g. the selects of stack's backward);
        # anything computed from a tangent or a backward value is backward too.
        tagged = node.meta.get("partitioner_tag") == "is_backward" or "autograd_backward" in node.meta
        is_bwd = tagged or any(a in self.backward for a in node.all_input_nodes)
        if is_bwd:
            self.backward.add(node)
        stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
        path = module_path(list(stack.values())[-1][0]) if stack else ""
        return Provenance(path, "bwd" if is_bwd else "fwd", source_line(node.meta.get("stack_trace")))

    def _outputs(self, node: fx.Node) -> None:
        descs = node.meta.get("desc") or []
        for val, desc in zip(node.args[0], descs, strict=False):
            if val is None or desc is None:
                continue
            kind_name = type(desc).__name__
            v = self._arg(val)
            if kind_name == "PlainAOTOutput":
                # NOTE: a non-tensor output (a string, an int) is a constant of the program, not a
                # value: the runtime returns it from ``output_structure``, keyed by the same index.
                if isinstance(v, Value):
                    self.b.add_output("out", str(desc.idx), v)
            elif kind_name == "GradAOTOutput":
                of = desc.grad_of
                of_name = type(of).__name__
                if of_name == "ParamAOTInput":
                    self.b.add_output("grad", self._fqn(of.target), v)
                elif of_name == "PlainAOTInput":
                    self.b.add_output("grad", self.arg_names[of.idx], v)
                else:
                    raise CaptureError(f"gradient of unsupported input {of!r}")
            elif kind_name == "InputMutationAOTOutput" and type(desc.mutated_input).__name__ == "BufferAOTInput":
                self.b.add_output("update", self._fqn(desc.mutated_input.target), v)
            else:
                self._unsupported_output(desc, val)

    def _unsupported_output(self, desc: Any, val: Any) -> None:
        """Raise for an output the IR has no kind for: an in-place update of a parameter or an input."""
        where = self._prov(val).describe() if isinstance(val, fx.Node) else "the model's forward"
        mutated = getattr(desc, "mutated_input", None)
        kind = type(mutated).__name__
        if kind == "ParamAOTInput":
            raise CaptureError(
                f"cannot capture the model: its forward updates parameter `{self._fqn(mutated.target)}` in place "
                f"at {where}; parameters change only in the optimizer step: compute the new value out of place "
                "(`w = w + 1` on a local), or update it outside the model's forward"
            )
        if kind == "PlainAOTInput":
            raise CaptureError(
                f"cannot capture the model: its forward updates its input `{self.arg_names[mutated.idx]}` in place "
                f"at {where}; compute the new value and return it instead"
            )
        raise CaptureError(f"cannot capture output {desc!r} at {where}: meshfold has no output kind for it")


def _flat_vals(val: Any) -> list[Any]:
    if isinstance(val, (tuple, list)):
        out: list[Any] = []
        for x in val:
            if isinstance(x, (tuple, list)):
                raise CaptureError("ops returning nested sequences are not supported")
            out.append(x)
        return out
    return [val]


def _result_hint(name: str, i: int, n: int) -> str:
    return name if n == 1 else f"{name}.{i}"
