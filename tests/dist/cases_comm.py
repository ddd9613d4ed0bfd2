"""Tasks for tests/dist/test_comm.py: one comm op's eager lowering (``backends/collectives.py``) on the ranks,
against the layouts it claims, and against the liveness estimate of its buffers."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from meshfold import ir
from meshfold.backends.collectives import issue, local_shapes
from meshfold.ir.dialects.ring import permuted
from meshfold.ir.ops import ALL_TO_ALL
from meshfold.passes.cost.liveness import rank_memory
from meshfold.tools.measure import settled_peak_new_bytes


def all_to_all(shape: tuple[int, ...], concat: int, split: int) -> dict[str, Any]:
    """``comm.all_to_all`` over every rank, from ``S(concat)`` to ``S(split)``, of a value the program
    makes (twice its input): this rank's result against its slice of the whole tensor (the same on
    every rank), plus the allocator's peak while the program runs and ``rank_memory``'s while the
    all-to-all does."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ", ".join(map(str, shape))
    graph = ir.parse(
        f"""graph @a2a mesh<x={world}> {{
  input %a : f32[{dims}] {{x: S({concat})}}
  %c = aten.mul.Tensor(%a, 2) : f32[{dims}] {{x: S({concat})}}  # m fwd
  %b = comm.all_to_all(%c, axis="x", concat_dim={concat}, split_dim={split}) : f32[{dims}] {{x: S({split})}}  # m fwd
  output out(0) = %b
}}
"""
    )
    assert graph.mesh is not None
    (op,) = [op for op in graph.ops if op.target == ALL_TO_ALL]
    g = fx.Graph()
    x = g.placeholder("x")
    group = dist.distributed_c10d._get_default_group().group_name
    twice = g.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    g.output(issue(g, op, [twice], world, group, rank, local_shapes(op, graph.mesh)).complete(g)[0])
    module = fx.GraphModule(torch.nn.Module(), g)
    whole = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    mine = whole.chunk(world, concat)[rank].contiguous()
    got = module(mine)
    est = rank_memory(graph, optimizer_states=0)
    return {
        "equal": torch.equal(got, 2 * whole.chunk(world, split)[rank]),
        "contiguous": got.is_contiguous(),
        "measured": settled_peak_new_bytes(lambda: module(mine), runs=3),
        # NOTE: while the all-to-all runs (the caller holds the input, so it is not counted in either)
        "estimated": next(during for name, during in est.timeline if name.startswith("comm.all_to_all")),
    }


def ppermute(shape: tuple[int, ...], dim: int, order: tuple[int, ...]) -> dict[str, Any]:
    """``comm.ppermute`` over every rank of a value split along ``dim``: this rank's result against its
    slice of the whole tensor with its pieces moved (``ir.dialects.ring.permuted``), as the IR reads it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ", ".join(map(str, shape))
    graph = ir.parse(
        f"""graph @moved mesh<x={world}> {{
  input %a : f32[{dims}] {{x: S({dim})}}
  %b = comm.ppermute(%a, axis="x", dim={dim}, order={list(order)}) : f32[{dims}] {{x: S({dim})}}  # m fwd
  output out(0) = %b
}}
"""
    )
    assert graph.mesh is not None
    (op,) = graph.ops
    g = fx.Graph()
    x = g.placeholder("x")
    group = dist.distributed_c10d._get_default_group().group_name
    g.output(issue(g, op, [x], world, group, rank, local_shapes(op, graph.mesh)).complete(g)[0])
    whole = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    got = fx.GraphModule(torch.nn.Module(), g)(whole.chunk(world, dim)[rank].contiguous())
    want = permuted(whole, dim, op.kwarg("order")).chunk(world, dim)[rank]  # type: ignore[arg-type]
    return {"equal": torch.equal(got, want), "contiguous": got.is_contiguous()}
