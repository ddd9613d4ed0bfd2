"""Tasks for the MoE dispatchers on ranks: equivalence with single device, plus how the compiled
experts ops are laid out (tokens split means the all-to-all exchange, replicated the all-gather)."""

from __future__ import annotations

from typing import Any

import torch

from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.tools.zoo import build
from meshfold.tracing.moe_layers import MoeSpec, experts_as_ops
from tests.dist.cases import equivalence


def dispatched(
    model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, moe: dict[str, Any]
) -> dict[str, Any]:
    """``equivalence`` with ``moe=``; adds, per experts op, the layouts of its tokens and weights."""
    out = equivalence(model, shape, names, plan, moe=moe, keep_module=True)
    if moe.get("capacity_factor") is not None:
        # NOTE: the same fresh model on one device through the same experts op, without and with the
        # drops: any difference is the drops'
        net, inputs = build(model)
        with torch.no_grad():
            with experts_as_ops(net):
                out["dropless_loss"] = float(net(*inputs))
            with experts_as_ops(net, MoeSpec.of(moe)):
                out["dropping_loss"] = float(net(*inputs))
    pm = out.pop("module")
    at = {EXPERTS: (0, 3), EXPERTS_BACKWARD: (1, 4)}
    out["experts_ops"] = [
        (str(op.operands[at[op.target][0]].layout), str(op.operands[at[op.target][1]].layout))
        for op in pm.graph().ops
        if op.target in at
    ]
    return out


def padded_splits(
    model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, moe: dict[str, Any]
) -> dict[str, Any]:
    """``dispatched``, recording the split sizes of every all-to-all the step makes."""
    import torch.distributed as dist

    calls: list[tuple[Any, Any]] = []
    real = dist.all_to_all_single

    def recording(
        output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None, **kw: Any
    ) -> Any:
        calls.append((output_split_sizes, input_split_sizes))
        return real(output, input, output_split_sizes, input_split_sizes, **kw)

    dist.all_to_all_single = recording  # type: ignore[assignment]
    try:
        out = dispatched(model, shape, names, plan, moe)
    finally:
        dist.all_to_all_single = real  # type: ignore[assignment]
    out["splits"] = calls
    return out


def skewed_exchange(pad: bool) -> float:
    """The all-to-all on 2 ranks when every pair routes to rank 0's experts (rank 1 receives nothing),
    with a capacity: forward and backward against the one-device op on all tokens. Returns the
    largest difference."""
    from meshfold.backends.experts.dispatch import Peers, exchange_backward, exchange_forward
    from meshfold.ir.dialects.moe import capacity_of, experts_range, experts_range_backward

    rank = torch.distributed.get_rank()
    group = torch.distributed.group.WORLD.group_name  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(0)
    tokens, h, inter, n_exp, k = 8, 4, 3, 4, 2
    hidden = torch.randn(2 * tokens, h, generator=g)
    idx = torch.zeros(2 * tokens, k, dtype=torch.long)
    idx[:, 1] = 1  # NOTE: experts 0 and 1 live on rank 0
    weights = torch.rand(2 * tokens, k, generator=g)
    gate_up, down = torch.randn(n_exp, 2, inter, h, generator=g), torch.randn(n_exp, h, inter, generator=g)
    grad = torch.randn(2 * tokens, h, generator=g)
    cap = capacity_of(2 * tokens, k, n_exp, 0.5)
    policy = "probs+pad" if pad else "probs"
    mine = slice(rank * tokens, (rank + 1) * tokens)
    ex = slice(rank * 2, rank * 2 + 2)
    peers = Peers(((group, 2, 1),), rank, (0, 2), 2)
    args = (hidden[mine], idx[mine], weights[mine], gate_up[ex], down[ex], "silu", cap, policy)
    got = exchange_forward(peers, *args)
    want = experts_range(0, hidden, idx, weights, gate_up, down, "silu", cap, policy)[mine]
    d_got = exchange_backward(peers, grad[mine], *args)
    d_all = experts_range_backward(0, grad, hidden, idx, weights, gate_up, down, "silu", cap, policy)
    d_want = (d_all[0][mine], d_all[1][mine], d_all[2][ex], d_all[3][ex])
    diffs = [float((got - want).abs().max())] + [float((a - b).abs().max()) for a, b in zip(d_got, d_want, strict=True)]
    assert float(want.abs().max()) > 0 and float(d_all[2].abs().max()) > 0, "a trivial case"
    return max(diffs)


def exchange_working_set(
    tokens: int, hidden: int, inter: int, n: int, k: int, rows: int
) -> tuple[list[int], list[int]]:
    """The all-to-all lowering of both experts ops on this rank (``tokens`` split over every rank,
    ``n`` experts too, ``rows`` pairs computed at a time): the allocator's peak while each runs, and
    ``ir.dialects.moe_memory.working_set`` plus its results for the same op. Returns (measured, estimated)."""
    from meshfold import ir
    from meshfold.backends.experts.dispatch import Peers, exchange_backward, exchange_forward
    from meshfold.ir.dialects.moe import with_rows
    from meshfold.ir.dialects.moe_memory import working_set
    from meshfold.ir.graph import local_nbytes
    from meshfold.tools.measure import settled_peak_new_bytes

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    group = torch.distributed.group.WORLD.group_name  # type: ignore[union-attr]
    split = "{ep: S(0)}"
    tensors = [
        f"f32[{tokens}, {hidden}]",
        f"f32[{tokens}, {k}]",
        f"f32[{n}, 2, {inter}, {hidden}]",
        f"f32[{n}, {hidden}, {inter}]",
    ]
    grads = ", ".join(f"{t} {split}" for t in tensors)
    graph = ir.parse(
        f"""graph @moe mesh<ep={world}> {{
  param %gu : {tensors[2]} {split}
  param %wd : {tensors[3]} {split}
  input %x : {tensors[0]} {split}
  input %idx : i64[{tokens}, {k}] {split}
  input %w : {tensors[1]} {split}
  input %gy : {tensors[0]} {split}
  %e = meshfold.moe_experts(%x, %idx, %w, %gu, %wd, "silu", 0, "probs", "alltoall") : {tensors[0]} {split}  # moe fwd
  %b.0, %b.1, %b.2, %b.3 = meshfold.moe_experts_backward(%gy, %x, %idx, %w, %gu, %wd, "silu", 0, "probs", \
"alltoall") : {grads}  # moe bwd
  output out(0) = %e
}}
"""
    )
    assert graph.mesh is not None
    mine, per = tokens // world, n // world
    g = torch.Generator().manual_seed(rank)
    x, gy = torch.randn(mine, hidden, generator=g), torch.randn(mine, hidden, generator=g)
    w, idx = torch.randn(mine, n, generator=g).softmax(-1).topk(k)
    gu, wd = torch.randn(per, 2, inter, hidden, generator=g), torch.randn(per, hidden, inter, generator=g)
    peers = Peers(((group, world, 1),), rank, tuple(range(0, n, per)), per)
    measured = [
        settled_peak_new_bytes(lambda: exchange_forward(peers, x, idx, w, gu, wd, "silu", rows=rows), runs=3),
        settled_peak_new_bytes(lambda: exchange_backward(peers, gy, x, idx, w, gu, wd, "silu", rows=rows), runs=3),
    ]
    ops = [with_rows(op, rows) for op in graph.ops if op.target in (EXPERTS, EXPERTS_BACKWARD)]
    estimated = [working_set(op, graph.mesh) + sum(local_nbytes(r, graph.mesh) for r in op.results) for op in ops]
    return measured, estimated
