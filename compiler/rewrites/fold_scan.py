"""A loop over chunks (or tokens) that carries a state updated linearly, made one
``meshfold.affine_scan``, in the forward graph dynamo captures, before the backward is traced.

Chunked linear attention (the gated delta rule of DeltaNet and Qwen3-Next as HF writes it without
its kernels, a scalar-decay linear attention) and a selective state-space scan (Mamba's, token by
token) run a Python loop::

    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + attn[:, :, i] @ v_new
        state = state * decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new

Dynamo unrolls it: ``n`` copies of one body, each reading slice ``i`` of some tensors and the state
the body before it left. Such a loop is a chain the sharding rules can only run on one rank. Here it
is recognised by its structure (every body the same ops on slice ``i`` of the same tensors, one
value carried from each body to the next); the state's update is written as an affine function of
the state, ``m @ state + b`` (or ``m * state + b``, element by element) with ``m`` and ``b`` free of
it, for every slice at once (the slices read whole, the loop's dim first: ``meshfold.rewrites.scan_forms``);
the update becomes ``affine_scan(m, b, s0)``, and every other value of the bodies is computed once
on the states it gives: what the bodies wrote slice by slice, stacked after the loop, or left in the
state after the last step.

The result computes the same function (products grouped differently round differently, as after
any reordering of a sum). A loop that does anything else (a nonlinear or right-multiplied update of
the state, a value of a body read after the loop other than those, an op whose meaning would change
with the added dim) is left as it is.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import fx

from meshfold.rewrites.scan_forms import Loop, NoFold, emit, one_int, pick, write


def fold_scans(gm: fx.GraphModule) -> int:
    """Fold every affine loop in ``gm`` (module docstring); returns how many."""
    folded, start = 0, 0
    while (found := _next_loop(gm.graph, start)) is not None:
        bodies, start = found
        try:
            _fold(gm.graph, bodies)
            folded += 1
        except NoFold:
            start += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _next_loop(graph: fx.Graph, start: int) -> tuple[list[list[fx.Node]], int] | None:
    """The bodies of the first unrolled loop whose slice-0 read sits at or after position ``start``
    (and that position): from that read on, nodes are tagged by the largest slice index they depend
    on, counting the reads from outside the loop whose index goes up by one at a time; a read of
    slice 0 after that starts another loop, which ends this one's reads."""
    nodes = list(graph.nodes)
    for pos in range(start, len(nodes)):
        p = pick(nodes[pos])
        if p is None or p[2] != 0:
            continue
        cur, closed = 0, False
        tag: dict[fx.Node, int] = {}
        bodies: dict[int, list[fx.Node]] = defaultdict(list)
        for n in nodes[pos:]:
            q = pick(n)
            inputs = [tag[a] for a in n.all_input_nodes if a in tag]
            read = q is not None and q[0] not in tag
            if read and not closed and q is not None and q[2] in (cur, cur + 1):
                cur = q[2]
                tag[n] = max([cur, *inputs])
            elif read and q is not None and q[2] == 0:
                closed = True
                continue
            elif inputs:
                tag[n] = max(inputs)
            else:
                continue
            bodies[tag[n]].append(n)
        if cur >= 1:
            return [bodies[i] for i in range(cur + 1)], pos
    return None


def _fold(graph: fx.Graph, bodies: list[list[fx.Node]]) -> None:
    """Rewrite one loop (module docstring), or raise ``NoFold`` having changed nothing."""
    size = len(bodies[0])
    if any(len(b) != size for b in bodies[1:-1]) or len(bodies[-1]) < size:
        raise NoFold
    bodies = [*bodies[:-1], bodies[-1][:size]]
    position = [{n: j for j, n in enumerate(b)} for b in bodies]
    carried = _carried(bodies, position)
    if carried is None:
        raise NoFold
    state_at, init = carried
    last_state = bodies[-1][state_at]
    inside = {n for b in bodies for n in b}
    stacks: list[tuple[fx.Node, int, int]] = []
    for u in {u for n in inside for u in n.users if u not in inside}:
        stacked = _stacked(u, bodies, position)
        if stacked is not None:
            stacks.append((u, *stacked))
        elif any(a in inside and a is not last_state for a in u.all_input_nodes):
            raise NoFold  # NOTE: after the loop only the final state and stacks of one value per body
    loop = Loop(bodies[0], state_at, init, len(bodies), stacks, last_state)
    before = set(graph.nodes)
    try:
        with graph.inserting_before(bodies[0][0]):
            targets = emit(graph, loop)
    except NoFold:
        for n in reversed(list(graph.nodes)):
            if n not in before:
                graph.erase_node(n)
        raise
    for u, _, _ in stacks:
        graph.erase_node(u)
    for b in reversed(bodies):
        for n in reversed(b):
            graph.erase_node(n)
    for t in targets:
        if not t.users:
            graph.erase_node(t)


def _stacked(u: fx.Node, bodies: list[list[fx.Node]], position: list[dict[fx.Node, int]]) -> tuple[int, int] | None:
    """``(j, dim)`` when ``u`` is ``torch.stack`` of every body's node ``j`` in order, along ``dim``."""
    if u.op != "call_function" or u.target is not torch.stack or not isinstance(u.args[0], (list, tuple)):
        return None
    items = list(u.args[0])
    dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)
    if len(items) != len(bodies) or not isinstance(dim, int) or not all(isinstance(x, fx.Node) for x in items):
        return None
    j = position[0].get(items[0])
    ok = j is not None and all(position[i].get(x) == j for i, x in enumerate(items))
    return (j, dim) if ok and j is not None else None


def _carried(bodies: list[list[fx.Node]], position: list[dict[fx.Node, int]]) -> tuple[int, fx.Node] | None:
    """``(j, s0)``: each body reads the previous body's node ``j`` (and the first reads ``s0``) where
    the others read nothing of another body; None unless every body is the first's ops on its own
    slice index, and exactly one value is carried."""
    state_at: int | None = None
    init: fx.Node | None = None
    for i, body in enumerate(bodies):
        for j, n in enumerate(body):
            ref = bodies[0][j]
            if (n.op, n.target) != (ref.op, ref.target) or len(n.args) != len(ref.args) or n.kwargs != ref.kwargs:
                return None
            # NOTE: a read from outside the loop, or a write, indexes slice i; other indices stay
            p, w = pick(ref), write(ref)
            indexed = (p is not None and p[0] not in position[0]) or w is not None
            for slot, (a, r) in enumerate(zip(n.args, ref.args, strict=True)):
                if isinstance(a, fx.Node):
                    if a in position[i]:
                        ok = position[i][a] == position[0].get(r)
                    elif i and a in position[i - 1]:
                        k = position[i - 1][a]
                        if state_at not in (None, k) or (init is not None and r is not init) or r in position[0]:
                            return None
                        state_at, init, ok = k, r, True
                    else:
                        ok = a is r
                elif indexed and slot == 1:
                    at, at_ref = one_int(a), one_int(r)
                    ok = at is not None and at_ref is not None and at == (at_ref[0], at_ref[1] + i)
                else:
                    ok = a == r
                if not ok:
                    return None
    if state_at is None or init is None:
        return None
    return state_at, init
