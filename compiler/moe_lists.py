"""Folding MoE layers whose experts are an ``nn.ModuleList`` into one ``meshfold.moe_experts`` op.

Works on dynamo's forward graph, before the backward is traced. An expert list qualifies when every
member is a gated MLP without biases, ``down(act(gate(x)) * up(x))``, read off the graph (which
linear is which comes from how they are wired, not from their names), and the layer combines the
experts' outputs in one of the two ways plain PyTorch MoE code does:

- the sparse loop: per expert ``e``, ``rows, slot = torch.where(top_k_index == e)``, the expert runs on
  ``hidden[rows]``, its output is scaled by ``top_k_weights[rows, slot, None]`` and ``index_add_``-ed into
  a zero-initialised result (shapes depend on the routing: this form cannot even be traced to a
  backward without folding);
- the dense stack: every expert runs on every token, ``torch.stack(outs, dim=1)`` is weighted by
  ``zeros.scatter(1, top_k_index, top_k_weights)`` and summed over the experts.

Both compute ``sum_j w[t, j] * expert_{i[t, j]}(hidden[t])``, which is the experts op. The folded
layer reads two stacked parameters named after the list, ``<list>.gate_up_proj [E, 2, I, H]`` (each
expert's gate and up weights) and ``<list>.down_proj [E, H, I]``, recorded in the graph as
``ir.ParamStack`` so the runtime builds them from the model's per-expert parameters. An expert list
in any other form is left as it is, replicated, and a warning names the layer.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from meshfold import ir
from meshfold.ir.moe import experts

# NOTE: the activations ir.moe implements, as dynamo records the calls.
_ACTS = {F.silu: "silu", F.relu: "relu", torch.relu: "relu"}
_LINEAR = (F.linear, torch._C._nn.linear)


@dataclass
class _Expert:
    """One expert's body in the graph: ``down(act(gate(x)) * up(x))``."""

    x: fx.Node
    y: fx.Node
    gate: fx.Node
    up: fx.Node
    down: fx.Node
    act: str
    nodes: list[fx.Node]


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
    from meshfold.tracer import module_path

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
    bodies = [_body(members[e]) for e in range(n)]
    if any(b is None for b in bodies):
        return None, "an expert is not a bias-free gated MLP, down(act(gate(x)) * up(x))"
    body = [b for b in bodies if b is not None]
    if len({b.act for b in body}) != 1:
        return None, "its experts use different activations"
    combine = _loop(body) or _dense(body)
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
    from meshfold.tracer import module_path

    user = next(iter(weight.users))
    stack = user.meta.get("nn_module_stack") or {}
    return f"{module_path(list(stack.values())[-1][0])}.weight"


def _body(nodes: list[fx.Node]) -> _Expert | None:
    """The expert's gated MLP, if ``nodes`` (one expert's graph nodes) are exactly one."""
    linears = [x for x in nodes if x.op == "call_function" and x.target in _LINEAR]
    acts = [x for x in nodes if x.op == "call_function" and (x.target in _ACTS or x.target is F.gelu)]
    muls = [x for x in nodes if x.op == "call_function" and x.target in (operator.mul, torch.mul)]
    weights = [x for x in nodes if x.op == "get_attr"]
    if len(linears) != 3 or len(acts) != 1 or len(muls) != 1 or len(weights) != 3 or len(nodes) != 8:
        return None
    if any((len(x.args) > 2 and x.args[2] is not None) or x.kwargs.get("bias") is not None for x in linears):
        return None
    mul, act = muls[0], acts[0]
    downs = [x for x in linears if x.args[0] is mul]
    act_name = _act_name(act)
    if len(downs) != 1 or len(mul.args) != 2 or act_name is None or len(act.args) != 1:
        return None
    down = downs[0]
    a, b = mul.args
    gate_lin, up_lin = (act.args[0], b) if a is act else (act.args[0], a) if b is act else (None, None)
    if gate_lin not in linears or up_lin not in linears or gate_lin is up_lin:
        return None
    assert isinstance(gate_lin, fx.Node) and isinstance(up_lin, fx.Node)
    x = gate_lin.args[0]
    if up_lin.args[0] is not x or not isinstance(x, fx.Node) or x in nodes:
        return None
    inner = {mul, act, gate_lin, up_lin, down, *weights}
    if any(set(node.users) - inner for node in (mul, act, gate_lin, up_lin)):
        return None
    gw, uw, dw = (lin.args[1] for lin in (gate_lin, up_lin, down))
    if not all(isinstance(w, fx.Node) and w.op == "get_attr" for w in (gw, uw, dw)):
        return None
    return _Expert(x, down, gw, uw, dw, act_name, list(nodes))  # type: ignore[arg-type]


def _act_name(act: fx.Node) -> str | None:
    """ir.moe's name for the activation ``act`` calls, or None."""
    if act.target is F.gelu:
        approximate = act.kwargs.get("approximate", "none")
        return (
            {"none": "gelu", "tanh": "gelu_tanh"}.get(str(approximate)) if set(act.kwargs) <= {"approximate"} else None
        )
    return _ACTS.get(act.target) if not act.kwargs else None  # type: ignore[call-overload]


@dataclass
class _Combine:
    """How a layer combines its experts: the op's operands, where it goes, what it replaces."""

    hidden: fx.Node
    index: fx.Node
    weights: fx.Node
    after: fx.Node
    """The op is inserted after this node."""
    rewire: Callable[[fx.Node], None]
    """Points the layer's result at the op's output ``y``."""
    dead: list[fx.Node]
    """Nodes to erase, in graph order (expert weights excluded)."""
    dtype: torch.dtype | None = None
    """Cast the routing weights to this dtype first."""


def _loop(body: list[_Expert]) -> _Combine | None:
    """The sparse loop: ``out.index_add_(0, rows, expert(hidden[rows]) * weights[rows, slot, None])``
    with ``rows, slot = torch.where(index == e)``, ``out`` a fresh tensor the loop adds into."""
    shared: tuple[object, ...] | None = None
    adds: list[fx.Node] = []
    dead: set[fx.Node] = set()
    for e, b in enumerate(body):
        gather = b.x
        if gather.target is not operator.getitem or len(gather.users) != 2:
            return None
        src, rows = gather.args
        if not (isinstance(rows, fx.Node) and rows.target is operator.getitem and rows.args[1] == 0):
            return None
        found = rows.args[0]
        if not (isinstance(found, fx.Node) and found.target is torch.where and len(found.args) == 1):
            return None
        mask = found.args[0]
        if not (isinstance(mask, fx.Node) and mask.target in (operator.eq, torch.eq) and mask.args[1] == e):
            return None
        users = list(b.y.users)
        if len(users) != 1 or users[0].target not in (operator.mul, torch.mul):
            return None
        scaled = users[0]
        scale = next((a for a in scaled.args if a is not b.y), None)
        if not (isinstance(scale, fx.Node) and scale.target is operator.getitem):
            return None
        table, at = scale.args
        if not (isinstance(at, tuple) and len(at) == 3 and at[0] is rows and at[2] is None):
            return None
        slot = at[1]
        if not (isinstance(slot, fx.Node) and slot.target is operator.getitem and slot.args == (found, 1)):
            return None
        adders = list(scaled.users)
        if len(adders) != 1 or adders[0].op != "call_method" or adders[0].target != "index_add_":
            return None
        add = adders[0]
        if add.args[1:] != (0, rows, scaled) or add.kwargs or add.users:
            return None
        here = (src, mask.args[0], table, add.args[0])
        if shared is None:
            shared = here
        elif here != shared:
            return None
        adds.append(add)
        # NOTE: everything computed from the data-dependent positions goes: the gathers, the sizes
        # dynamo read off them and its runtime asserts on those sizes.
        closure = _closure(found)
        picks = {x for x in closure if x.target is operator.getitem and x.args[0] is found}
        allowed = set(b.nodes) | picks | {found, gather, scale, scaled, add} | _size_checks(closure)
        if not closure <= allowed:
            return None
        dead |= closure
        if len(mask.users) == 1:
            dead.add(mask)
    assert shared is not None
    hidden, index, weights, out = shared
    assert isinstance(out, fx.Node)
    order = {node: i for i, node in enumerate(out.graph.nodes)}
    last = max(adds, key=order.__getitem__)
    later = [u for u in out.users if u not in adds]
    if any(order[u] < order[last] for u in later):
        return None

    def rewire(y: fx.Node) -> None:
        total = y.graph.call_function(operator.add, (out, y))
        for u in later:
            u.replace_input_with(out, total)

    return _Combine(hidden, index, weights, last, rewire, sorted(dead, key=order.__getitem__))  # type: ignore[arg-type]


def _closure(root: fx.Node) -> set[fx.Node]:
    seen = {root}
    todo = [root]
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


_SIZE_OPS = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten._assert_scalar.default,
    operator.ge,
    operator.le,
    operator.lt,
    operator.gt,
    operator.eq,
    torch._check_is_size,
}


def _size_checks(nodes: set[fx.Node]) -> set[fx.Node]:
    """The nodes among ``nodes`` that only read or assert on sizes (dynamo's unbacked-size guards)."""
    return {x for x in nodes if x.target in _SIZE_OPS}


def _dense(body: list[_Expert]) -> _Combine | None:
    """The dense stack: ``(zeros.scatter(1, index, weights)[..., None] * torch.stack(outs, 1)).sum(1)``."""
    hidden = body[0].x
    if any(b.x is not hidden for b in body) or any(len(b.y.users) != 1 for b in body):
        return None
    stack = next(iter(body[0].y.users))
    if stack.target is not torch.stack or list(stack.args[0]) != [b.y for b in body]:  # type: ignore[call-overload]
        return None
    if (stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim")) != 1 or len(stack.users) != 1:
        return None
    scaled = next(iter(stack.users))
    if scaled.target not in (operator.mul, torch.mul) or len(scaled.users) != 1:
        return None
    unsq = next((a for a in scaled.args if a is not stack), None)
    if not (isinstance(unsq, fx.Node) and unsq.op == "call_method" and unsq.target == "unsqueeze"):
        return None
    if unsq.args[1] not in (-1, 2) or len(unsq.users) != 1:
        return None
    dense = unsq.args[0]
    chain = [unsq]
    if isinstance(dense, fx.Node) and dense.op == "call_method" and dense.target == "to" and len(dense.users) == 1:
        chain.append(dense)
        dense = dense.args[0]
    if not (isinstance(dense, fx.Node) and dense.target in ("scatter", torch.scatter) and dense.args[1:2] == (1,)):
        return None
    base, _, index, weights = dense.args[:4]
    if not (isinstance(base, fx.Node) and base.target in (torch.zeros_like, torch.zeros)):
        return None
    if len(dense.users) == 1:
        chain.append(dense)
        if len(base.users) == 1:
            chain.append(base)
    summed = next(iter(scaled.users))
    if not (summed.op == "call_method" and summed.target == "sum"):
        return None
    dim = summed.args[1] if len(summed.args) > 1 else summed.kwargs.get("dim")
    if dim != 1 or summed.kwargs.get("keepdim", False):
        return None
    dtype = unsq.meta["example_value"].dtype
    order = {node: i for i, node in enumerate(stack.graph.nodes)}

    def rewire(y: fx.Node) -> None:
        summed.replace_all_uses_with(y)

    dead = {summed, scaled, stack, *chain}
    for b in body:
        dead |= {x for x in b.nodes if x.op != "get_attr"}
    return _Combine(hidden, index, weights, summed, rewire, sorted(dead, key=order.__getitem__), dtype)  # type: ignore[arg-type]


__all__ = ["as_stacked", "as_unstacked", "expert_lists", "fold_expert_lists", "stack_tensors", "unstack_tensors"]
