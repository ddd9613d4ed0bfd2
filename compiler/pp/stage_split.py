"""A compiled program split into pipeline stages at its layer stack's boundaries.

Pipeline parallelism starts at capture: every layer of the model's layer stack (its longest
``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict`` of numbered layers) reads its hidden states
through ``meshfold.stage_in`` (``marked_layers``), whose backward is ``meshfold.stage_in_grad``, so
the joint graph names at each layer the value that enters it and the gradient that leaves it
(``ir.dialects.stage``). After the passes, each rank's program is cut at the layers ``passes.stages.split_layers``
chooses:

* an op of layer ``k`` runs on the stage holding ``k``; a forward op of no layer runs on the latest
  stage among its operands' (the final norm and the loss after the stack), a backward op on the
  earliest (the embedding's gradient before it); an op reading only the program's inputs (the
  embedding lookup, the rotary tables, a parameter's all-gather) runs on every stage that reads
  its result, so what every layer reads is computed where it is read instead of sent;
* stage ``s`` receives ``stage_in``'s operand at its first layer and returns that layer's
  ``stage_in_grad`` result as the gradient of it; it sends the operand of the next stage's first
  ``stage_in`` and takes its gradient as its one tangent;
* a weight several stages read (input and output embeddings tied) is held by each of them; each
  returns its part of the gradient (the terms of the sum the joint graph adds them in), and the
  ranks holding it add the parts after the step (``meshfold.pp.pipelined``), so the copies stay equal;
* anything else crossing a boundary (a layer's value read by a later stage: a skip connection, an
  auxiliary loss pooled over all layers) is refused, naming the op, its module and source line.

Each stage is then a program of its own (``stage_graphs``), lowered like any other.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from meshfold.ir import Graph, GraphInput, GraphOutput, Op, TensorType, Value
from meshfold.ir.dialects.stage import STAGE_IN, STAGE_IN_GRAD, stage_in
from meshfold.ir.ops import draws
from meshfold.passes.base import PassError
from meshfold.passes.blocks import op_blocks
from meshfold.passes.stages import StageSplit
from meshfold.pp.tied import tied_parts
from meshfold.tracing.layer_runs import numbered_layers


def layer_stack(model: nn.Module) -> str:
    """The path of ``model``'s layer stack: its ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict``
    of children keyed ``0, 1, ...`` (``layer_runs.numbered_layers``) with the most layers (the first
    of the longest) among those inside no other. NOTE: a list inside a layer is a part of it, however
    long: StableLM's per-head qk norms are a list of 32 in each of its 24 layers."""
    best: tuple[int, str] | None = None
    stacks: list[str] = []
    for path, mod in model.named_modules():
        n = numbered_layers(mod)
        if n < 2 or any(path.startswith(f"{s}.") for s in stacks):
            continue
        stacks.append(path)
        if best is None or n > best[0]:
            best = (n, path)
    if best is None:
        raise PassError(
            f"pipeline parallelism splits a model between the layers of its layer stack (an nn.ModuleList, "
            f"nn.Sequential or nn.ModuleDict keyed '0', '1', ... of two or more layers); {type(model).__name__} "
            "has none: hold the layers in one"
        )
    return best[1]


@contextlib.contextmanager
def marked_layers(model: nn.Module) -> Iterator[str]:
    """For the duration, every layer of ``model``'s layer stack reads its hidden states (its first
    tensor argument, or ``hidden_states=``) through ``stage_in``; yields the stack's path."""
    path = layer_stack(model)
    stack = model.get_submodule(path)
    layers = stack.values() if isinstance(stack, nn.ModuleDict) else stack
    handles = [layer.register_forward_pre_hook(_mark, with_kwargs=True) for layer in layers]
    try:
        yield path
    finally:
        for h in handles:
            h.remove()


def _mark(_layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return (*args[:i], stage_in(a), *args[i + 1 :]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, kwargs | {"hidden_states": stage_in(kwargs["hidden_states"])}
    raise PassError("pipeline parallelism: a layer of the layer stack was called without a tensor to pass on")


@dataclass(frozen=True)
class Layers:
    """Where a program's layer stack is: its path and, per op, the layer it belongs to (-1: none)."""

    family: str
    layer: tuple[int, ...]
    count: int

    @staticmethod
    def of(graph: Graph) -> Layers:
        # NOTE: forward marks only (a layer the memory pass recomputes runs its mark again in the backward)
        blocks = op_blocks(graph)
        marks = [b for op, b in zip(graph.ops, blocks, strict=True) if is_mark(op, STAGE_IN)]
        if not marks:
            raise PassError(
                "this program has no stage marks: it was not captured for pipeline parallelism (Options pp=)"
            )
        family = marks[0].rsplit(".", 1)[0]
        prefix = family + "."
        layer = [int(b[len(prefix) :]) if b.startswith(prefix) and b[len(prefix) :].isdigit() else -1 for b in blocks]
        _before_the_marks(graph, layer)
        return Layers(family, tuple(layer), max(layer) + 1)


def _before_the_marks(graph: Graph, layer: list[int]) -> None:
    """Ops a pass put between a layer's mark and the layer before it (a layout change of the hidden
    states on their way in, of their gradient on its way out) carry the layer's module; they belong
    to the layer before, so that what passes between two stages is the mark's operand and result."""
    made = {r: i for i, op in enumerate(graph.ops) for r in op.results}
    users: dict[Value, list[int]] = defaultdict(list)
    for i, op in enumerate(graph.ops):
        for v in op.operands:
            users[v].append(i)
    for i, op in enumerate(graph.ops):
        k = layer[i]
        if op.target == STAGE_IN:
            todo = [made[v] for v in op.operands if v in made]
            while todo:
                j = todo.pop()
                if layer[j] == k:
                    layer[j] = k - 1
                    todo += [made[v] for v in graph.ops[j].operands if v in made]
        elif op.target == STAGE_IN_GRAD:
            after = [u for r in op.results for u in users[r]]
            while after:
                j = after.pop()
                if layer[j] == k:
                    layer[j] = k - 1
                    after += [u for r in graph.ops[j].results for u in users[r]]


def placement(graph: Graph, layers: Layers, stage_of: Callable[[int], int]) -> list[frozenset[int]]:
    """The stages each op runs on (see the module docstring), given the stage of each layer."""
    ops = graph.ops
    made: dict[Value, int] = {r: i for i, op in enumerate(ops) for r in op.results}
    # NOTE: values of the buffers and user inputs alone (the rotary tables, a mask): common-subexpression
    # elimination keeps one copy of what every layer computed alike, in whichever layer came first, so
    # where they are computed follows where they are read, never the module they were found in
    plain = {i.value for i in graph.inputs if i.kind in ("buffer", "input")}
    fixed: list[int | None] = [None] * len(ops)
    for i, op in enumerate(ops):
        if all(v in plain for v in op.operands):
            plain.update(op.results)
            continue
        if layers.layer[i] >= 0:
            fixed[i] = stage_of(layers.layer[i])
            continue
        staged = [s for v in op.operands if v in made and (s := fixed[made[v]]) is not None]
        if staged:
            fixed[i] = max(staged) if op.prov.phase == "fwd" else min(staged)
    users: dict[int, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        for v in op.operands:
            if v in made:
                users[made[v]].append(i)
    out: list[frozenset[int]] = [frozenset()] * len(ops)
    for i in reversed(range(len(ops))):
        f = fixed[i]
        if f is not None:
            out[i] = frozenset({f})
        else:
            # NOTE: an op of the inputs alone runs where its result is read (nowhere read: the first stage)
            out[i] = frozenset().union(*(out[u] for u in users[i])) or frozenset({0})
    return out


def stage_graphs(graph: Graph, split: StageSplit) -> list[Graph]:
    """``graph`` as one program per stage of ``split`` (see the module docstring)."""
    layers = Layers.of(graph)
    loss = loss_output(graph)
    random = next((op for op in graph.ops if draws(op)), None)
    if random is not None:
        raise PassError(
            f"pipeline parallelism: {random.describe()} draws random numbers (dropout, "
            "sampled routing, noise); each microbatch would draw its own, which are not the single-device model's "
            "draws over the whole batch. Train it pipelined without the draw (dropout p=0), or under a plan "
            "without pp"
        )
    n = len(split.times)
    where = placement(graph, layers, split.stage_of)
    joins, parts, extra = tied_parts(graph, where)
    tied = {name for _, name in parts}
    marks: dict[tuple[Any, int], Op] = {}
    for op, k in zip(graph.ops, layers.layer, strict=True):
        if (is_mark(op, STAGE_IN) or is_mark(op, STAGE_IN_GRAD)) and k >= 0:
            marks[(op.target, k)] = op
    made = {r: op for op in graph.ops for r in op.results}
    for k in split.bounds[1:-1]:
        if (STAGE_IN, k) not in marks or (STAGE_IN_GRAD, k) not in marks:
            raise PassError(
                f"pipeline parallelism: layer {layers.family}.{k} starts a stage, but the hidden states it "
                "receives never reached it as its first tensor argument (or hidden_states=) in the captured "
                "program; a layer of the stack must take the hidden states it passes on"
            )
    out = []
    for s in range(n):
        first, end = split.bounds[s], split.bounds[s + 1]
        received = marks[(STAGE_IN, first)].operands[0] if s > 0 else None
        sent_back = marks[(STAGE_IN_GRAD, first)].results[0] if s > 0 else None
        sent = marks[(STAGE_IN, end)].operands[0] if s < n - 1 else None
        tangent = marks[(STAGE_IN_GRAD, end)].results[0] if s < n - 1 else None
        ops = [op for i, (op, at) in enumerate(zip(graph.ops, where, strict=True)) if s in at and i not in joins]
        ops += extra.get(s, [])
        defined = {r for op in ops for r in op.results}
        given = {i.value for i in graph.inputs}
        crossing = {v for v in (received, tangent) if v is not None}
        for op in ops:
            for v in op.operands:
                if v not in defined and v not in given and v not in crossing:
                    raise PassError(_crossing(op, v, made[v], s, where[graph.ops.index(made[v])]))
        used = {v for op in ops for v in op.operands}
        outputs: list[GraphOutput] = []
        if s == n - 1:
            outputs.append(loss)
        else:
            assert sent is not None
            outputs.append(GraphOutput("out", f"stage{s}", sent))
        outputs += [
            o for o in graph.outputs if o.kind == "grad" and o.name not in tied and o.value in defined | (used & given)
        ]
        outputs += [GraphOutput("grad", name, v) for (at, name), v in sorted(parts.items(), key=_by_name) if at == s]
        for o in outputs:
            if o.value not in defined and o.value not in given:
                raise PassError(
                    f"pipeline stage {s} (layers {first}-{end - 1}) returns {o.kind} {o.name!r}, which another stage "
                    f"computes: a model output must come from the last stage"
                )
        if received is not None and sent_back is not None:
            outputs.append(GraphOutput("grad", received.name, sent_back))
        updates = [o.name for o in graph.outputs if o.kind == "update" and o.value in defined]
        if updates:
            raise PassError(
                f"pipeline stage {s} updates buffers in place ({', '.join(updates)}): under pipeline "
                "parallelism each microbatch would update them again; use a model without running statistics"
            )
        returned = {o.value for o in outputs}
        inputs = [i for i in graph.inputs if i.kind != "tangent" and (i.value in used or i.value in returned)]
        if received is not None:
            inputs.append(GraphInput("input", received))
        inputs += [i for i in graph.inputs if i.kind == "tangent" and i.value in used]
        if tangent is not None:
            inputs.append(GraphInput("tangent", tangent))
        name = f"{graph.name}_stage{s}"
        out.append(replace(graph, name=name, inputs=tuple(inputs), ops=tuple(ops), outputs=tuple(outputs)))
    return out


def loss_output(graph: Graph) -> GraphOutput:
    """The model's loss: its one scalar floating-point output, which a pipeline's last stage returns and
    ``step`` averages over the microbatches; the model's other outputs (logits beside the loss) are
    not returned. Raises when there is no such output, or several."""
    outs = [o for o in graph.outputs if o.kind == "out"]
    scalars = [
        o for o in outs if isinstance(t := o.value.type, TensorType) and t.rank == 0 and t.dtype.is_floating_point
    ]
    if len(scalars) != 1:
        given = ", ".join(f"{o.name}: {o.value.type}" for o in outs) or "none"
        raise PassError(
            f"pipeline parallelism trains on the model's loss, its one scalar floating-point output; the model "
            f"returns {len(scalars)} such among its tensor outputs ({given}): return the loss alone, or beside "
            "outputs that are not scalars"
        )
    return scalars[0]


def is_mark(op: Op, target: Any) -> bool:
    """``op`` is the forward's ``stage_in`` or the backward's ``stage_in_grad`` (not a recomputed copy)."""
    return op.target == target and op.prov.phase == ("fwd" if target == STAGE_IN else "bwd")


def _by_name(item: tuple[tuple[int, str], Value]) -> tuple[int, str]:
    return item[0]


def _crossing(op: Op, v: Value, src: Op, s: int, at: frozenset[int]) -> str:
    return (
        f"{op.describe()} on pipeline stage {s} reads %{v.name}, made by {src.describe()} on stage "
        f"{'/'.join(map(str, sorted(at)))}: only the hidden states a layer of the layer stack receives (and "
        "their gradient) pass between stages. Values a later layer reads from an earlier one (a skip "
        "connection, an auxiliary loss collected over all layers) cannot be split there; keep them inside one "
        "stage or compute them from the hidden states"
    )
