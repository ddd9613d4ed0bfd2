"""A pipeline stage's backward in two programs: its input's gradient first, its weights' after."""

from __future__ import annotations

import torch

from meshfold.backends.eager import Lowered, RankContext, build_module
from meshfold.backends.phases import phases, recorded_values
from meshfold.ir import Graph, Op, Value


def lower_split(
    graph: Graph, rank: RankContext, first: str, rng: torch.Generator | None = None, *, record: bool = False
) -> Lowered:
    """``lower``'s result with the backward in two: ``backward`` computes gradient ``first`` (the
    gradient of a pipeline stage's input, which the stage before waits for) and what it needs;
    ``weights`` the other gradients (the stage's weights', which zero-bubble schedules compute
    later, in what would be the pipeline's bubble). ``record``: as ``lower``'s, each of the three
    modules also returns the local value of every tensor its ops produce, last."""
    ph = phases(graph)
    gen = rng if rng is not None else torch.default_generator
    saved, tangents, bwd_ops, grads, fwd_inputs, fwd_out = (
        ph.saved,
        ph.tangents,
        ph.bwd_ops,
        ph.grads,
        ph.fwd_inputs,
        ph.fwd_out,
    )
    fwd_rec = recorded_values(ph.fwd_ops) if record else []
    forward = build_module(
        [i.value for i in fwd_inputs], ph.fwd_ops, [o.value for o in fwd_out] + saved + fwd_rec, rank, gen
    )
    made = {r: op for op in bwd_ops for r in op.results}
    wanted = [o for o in grads if o.name == first]
    need: set[Op] = set()
    todo = [o.value for o in wanted]
    while todo:
        op = made.get(todo.pop())
        if op is not None and op not in need:
            need.add(op)
            todo.extend(op.operands)
    early = [op for op in bwd_ops if op in need]
    late = [op for op in bwd_ops if op not in need]
    defined = {r for op in early for r in op.results}
    rest = [o for o in grads if o.name != first]
    handoff: list[Value] = []
    for v in [*(u for op in late for u in op.operands), *(o.value for o in rest)]:
        if v in defined and v not in handoff:
            handoff.append(v)
    ins = saved + [i.value for i in tangents]
    early_rec, late_rec = (recorded_values(early), recorded_values(late)) if record else ([], [])
    backward = build_module(ins, early, [o.value for o in wanted] + handoff + early_rec, rank, gen, len(wanted))
    weights = build_module(ins + handoff, late, [o.value for o in rest] + late_rec, rank, gen, len(rest))
    return Lowered(
        forward,
        backward,
        tuple(i.name for i in ph.fwd_inputs),
        tuple((o.kind, o.name) for o in ph.fwd_out),
        len(saved),
        tuple(i.name for i in tangents),
        tuple(o.name for o in wanted),
        tuple(fwd_rec),
        tuple(early_rec),
        weights=weights,
        weight_outputs=tuple(o.name for o in rest),
        handoff=len(handoff),
        weight_recorded=tuple(late_rec),
    )
