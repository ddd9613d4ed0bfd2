"""Folding MoE layers whose experts are an ``nn.ModuleList`` into one ``meshfold.moe_experts`` op.

Works on dynamo's forward graph, before the backward is traced. An expert list qualifies when every
member is a gated MLP without biases and the layer combines the experts' outputs in a form
:mod:`meshfold.rewrites.moe_forms` reads (a per-expert sparse loop, or a dense weighted stack). The folded
layer reads two stacked parameters named after the list, ``<list>.gate_up_proj [E, 2, I, H]`` (each
expert's gate and up weights) and ``<list>.down_proj [E, H, I]``, recorded in the graph as
``ir.ParamStack`` so the runtime builds them from the model's per-expert parameters. An expert list
in any other form is left as it is, replicated, and a warning names the layer.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from meshfold import ir
from meshfold.ir.dialects.moe import experts
from meshfold.rewrites.module_paths import module_path
from meshfold.rewrites.moe_forms import combine_of, expert_body


@dataclass
class _Folded:
    """What folding one layer changed, for the capture to name and the runtime to build."""

    stacks: tuple[ir.ParamStack, ir.ParamStack]
    attrs: tuple[str, str]


def stack_tensors(stacks: tuple[ir.ParamStack, ...], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stack in ``stacks`` built from ``tensors`` by FQN (parameters, or their gradients)."""
    return {s.name: torch.stack([_row([tensors[m] for m in row]) for row in s.members]) for s in stacks}


def _row(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.stack(parts)


def unstack_tensors(stacks: tuple[ir.ParamStack, ...], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's own parameters (by FQN) cut back out of stacked ``tensors`` (full, not sharded)."""
    out: dict[str, torch.Tensor] = {}
    for s in stacks:
        whole = tensors[s.name]
        for e, row in enumerate(s.members):
            out.update(zip(row, whole[e].unbind(0) if len(row) > 1 else (whole[e],), strict=True))
    return out


def as_stacked(stacks: tuple[ir.ParamStack, ...], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` named as the compiled model names them: each stack's members replaced by the stack."""
    members = {m for s in stacks for row in s.members for m in row}
    return {n: t for n, t in tensors.items() if n not in members} | stack_tensors(stacks, tensors)


def as_unstacked(stacks: tuple[ir.ParamStack, ...], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` named as the model names them: each stack replaced by its members."""
    stacked = {s.name for s in stacks}
    return {n: t for n, t in tensors.items() if n not in stacked} | unstack_tensors(stacks, tensors)


def expert_lists(model: nn.Module) -> dict[str, nn.ModuleList]:
    """``nn.ModuleList``s of two or more modules of one type, each holding two or three bias-free
    ``nn.Linear`` and no other parameters: the candidates for folding."""
    out: dict[str, nn.ModuleList] = {}
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2 or len({type(m) for m in mod}) != 1:
            continue
        if all(_linear_only(m) for m in mod):
            out[path] = mod
    return out


def _linear_only(mod: nn.Module) -> bool:
    linears = [m for m in mod.modules() if isinstance(m, nn.Linear)]
    n_params = len(list(mod.parameters()))
    return len(linears) in (2, 3) and all(m.bias is None for m in linears) and n_params == len(linears)


def fold_expert_lists(
    gm: fx.GraphModule, model: nn.Module, fake_mode: FakeTensorMode, options: tuple[str, float, str]
) -> tuple[dict[str, str], tuple[ir.ParamStack, ...]]:
    """Rewrite ``gm`` (dynamo's forward graph of ``model``) so every expert list in a form meshfold
    knows runs as one experts op on stacked parameters (``options``: dispatcher, capacity factor,
    drop policy). Returns the new parameters' FQNs by ``gm`` attribute, and their stacks; warns for
    each expert list left as it is."""
    lists = expert_lists(model)
    for path, mod in model.named_modules():
        if path.rpartition(".")[2] == "experts" and isinstance(mod, nn.ModuleList) and path not in lists:
            warnings.warn(
                f"MoE layer {path.rpartition('.')[0] or '<root>'}: its {len(mod)} experts are an nn.ModuleList of "
                "modules other than bias-free linear MLPs; they stay replicated (write the experts as stacked "
                "[E, ...] weights, or call meshfold.moe_experts, to have them split by expert)",
                stacklevel=3,
            )
    if not lists:
        return {}, ()
    regions: dict[str, dict[int, list[fx.Node]]] = {path: {} for path in lists}
    for node in gm.graph.nodes:
        where = _list_member(node, lists, module_path)
        if where is not None:
            regions[where[0]].setdefault(where[1], []).append(node)
    names: dict[str, str] = {}
    stacks: list[ir.ParamStack] = []
    for k, (path, members) in enumerate(regions.items()):
        if not members:
            continue
        folded, why = _fold_one(gm, path, members, len(lists[path]), fake_mode, options, k)
        if folded is None:
            warnings.warn(
                f"MoE layer {path.rsplit('.', 1)[0] or '<root>'}: its {len(lists[path])} experts are an nn.ModuleList "
                f"that meshfold does not fold ({why}); they stay replicated (write the experts as stacked [E, ...] "
                "weights, or call meshfold.moe_experts, to have them split by expert)",
                stacklevel=4,
            )
            continue
        names.update(zip(folded.attrs, (s.name for s in folded.stacks), strict=True))
        stacks.extend(folded.stacks)
    if stacks:
        gm.graph.lint()
        gm.recompile()
    return names, tuple(stacks)


def _list_member(
    node: fx.Node, lists: Mapping[str, nn.ModuleList], module_path: Callable[[str], str]
) -> tuple[str, int] | None:
    """(list FQN, member index) of the innermost candidate list member ``node`` runs in, if any."""
    stack = node.meta.get("nn_module_stack") or {}
    found = None
    for raw, _ in stack.values():
        path = module_path(raw)
        head, _, tail = path.rpartition(".")
        if head in lists and tail.isdigit():
            found = (head, int(tail))
    return found


def _fold_one(
    gm: fx.GraphModule,
    path: str,
    members: dict[int, list[fx.Node]],
    n: int,
    fake_mode: FakeTensorMode,
    options: tuple[str, float, str],
    k: int,
) -> tuple[_Folded | None, str]:
    if sorted(members) != list(range(n)):
        return None, "not every expert runs"
    bodies = [expert_body(members[e]) for e in range(n)]
    if any(b is None for b in bodies):
        return None, "an expert is not a bias-free gated MLP, down(act(gate(x)) * up(x))"
    body = [b for b in bodies if b is not None]
    if len({b.act for b in body}) != 1:
        return None, "its experts use different activations"
    combine = combine_of(body)
    if combine is None:
        return None, "its experts' outputs are combined in a way meshfold does not recognize"
    attrs = (f"_mf_experts_{k}_gate_up", f"_mf_experts_{k}_down")
    shapes = {tuple(tuple(gm.get_parameter(str(w.target)).shape) for w in (b.gate, b.up, b.down)) for b in body}
    if len(shapes) != 1:
        return None, "its experts differ in size"
    # NOTE: gate/up as [E, 2, I, H]: splitting I (ETP) then keeps each rank's gate and up rows together.
    with fake_mode:
        gate_up = torch.stack(
            [torch.stack([gm.get_parameter(str(b.gate.target)), gm.get_parameter(str(b.up.target))]) for b in body]
        )
        down = torch.stack([gm.get_parameter(str(b.down.target)) for b in body])
    gm.register_parameter(attrs[0], nn.Parameter(gate_up))
    gm.register_parameter(attrs[1], nn.Parameter(down))
    members_gu = tuple((_fqn(b.gate), _fqn(b.up)) for b in body)
    members_dn = tuple((_fqn(b.down),) for b in body)
    g = gm.graph
    dispatcher, factor, policy = options
    with g.inserting_after(combine.after):
        new = [g.get_attr(attrs[0]), g.get_attr(attrs[1])]
        weights = combine.weights
        if combine.dtype is not None:
            weights = g.call_method("to", (weights, combine.dtype))
            new.append(weights)
        args = (combine.hidden, combine.index, weights, new[0], new[1], body[0].act, factor, policy, dispatcher)
        out = g.call_function(experts, args)
        new.append(out)
    # NOTE: inserting_after puts each node right after ``after``: put them back in creation order.
    for a, b in itertools.pairwise(new):
        a.append(b)
    # NOTE: the op runs in the list's module, and its source line is where the layer combines the experts
    out.meta["nn_module_stack"] = dict(combine.after.meta.get("nn_module_stack") or {}) | {
        f"meshfold_experts_{k}": (path, nn.ModuleList)
    }
    if "stack_trace" in combine.after.meta:
        out.meta["stack_trace"] = combine.after.meta["stack_trace"]
    with g.inserting_after(out):
        combine.rewire(out)
    for node in reversed(combine.dead):
        g.erase_node(node)
    for b in body:
        for w in (b.gate, b.up, b.down):
            target = str(w.target)
            if not w.users:
                g.erase_node(w)
            if not any(x.op == "get_attr" and x.target == target for x in g.nodes):
                delattr(gm, target)
    return _Folded(
        (ir.ParamStack(f"{path}.gate_up_proj", members_gu), ir.ParamStack(f"{path}.down_proj", members_dn)), attrs
    ), ""


def _fqn(weight: fx.Node) -> str:
    """The model FQN of an expert's linear weight, from the module stack of the linear using it."""
    user = next(iter(weight.users))
    stack = user.meta.get("nn_module_stack") or {}
    return f"{module_path(list(stack.values())[-1][0])}.weight"


__all__ = ["as_stacked", "as_unstacked", "expert_lists", "fold_expert_lists", "stack_tensors", "unstack_tensors"]
