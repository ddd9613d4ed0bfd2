"""Tasks for tests/dist/test_dtypes.py: values of every dtype the IR holds through every ``comm.*`` op
(``backends/collectives.py``), eagerly, compiled by Inductor and traced for Ascend, in gloo's forms and in
the forms NCCL and HCCL run, against what each collective must give (computed on one rank from every
rank's operands); the point-to-point exchanges of ring attention and the host tier on the same values;
and the reductions the IR refuses (``ir.placement.reduce_refusal``), refused before any collective runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from meshfold import ir
from meshfold.backends import ascend
from meshfold.backends.context_parallel import p2p
from meshfold.backends.context_parallel.ring_attention import sequence_shard
from meshfold.backends.context_parallel.ring_lowering import from_zigzag, to_zigzag
from meshfold.backends.eager import RankContext, build_module
from meshfold.backends.host_tier import offload, reload
from meshfold.backends.inductor import Compiled
from meshfold.backends.traceable import plain
from meshfold.ir.dialects.ring import permuted, shift_order, zigzag_order
from meshfold.ir.graph import local_nbytes
from meshfold.ir.types import DTYPES_BY_NAME, is_float8

SHAPE = (8, 12)
"""Every value's global shape: on 2 or 4 ranks dim 0 splits in twice as many pieces (a zigzag permute)."""


def _allows(dtype: torch.dtype, reduce: str) -> bool:
    """Whether the IR permits ``reduce`` of ``dtype`` values (``ir.placement.reduce_refusal``, restated): a
    max of anything but complex values, a mean of floating-point and complex ones, a sum of all but bools;
    no reduction of float8 values (they only move)."""
    if is_float8(dtype):
        return False
    if reduce == "max":
        return not dtype.is_complex
    if reduce == "avg":
        return dtype.is_floating_point or dtype.is_complex
    return dtype != torch.bool


def _program(names: tuple[str, ...], n: int) -> str:
    """One graph moving values of each dtype in ``names`` through every comm op over ``n`` ranks (the
    reductions ``reduce_refusal`` allows): inputs ``s0``/``s1`` split along dim 0/1, ``r`` whole,
    ``p``/``a``/``m`` partial sums, means and maxima; a gather, a reduce-scatter and a bucket started
    and waited on later (``ir.asynchrony``), the rest run where they stand."""
    t = ", ".join(map(str, SHAPE))
    lines = [f"graph @dtypes mesh<x={n}> {{"]
    ops: list[str] = []
    outs: list[str] = []

    def op(results: str, call: str, layouts: list[str], d: str) -> None:
        types = ", ".join(f"{d}[{t}] {{x: {lay}}}" for lay in layouts)
        ops.append(f"  {results} = {call} : {types}  # m fwd")

    for d in names:
        dtype = DTYPES_BY_NAME[d]
        inputs = [("s0", "S(0)"), ("s1", "S(1)"), ("r", "R")]
        inputs += [(k, f"P({red})") for k, red in (("p", "sum"), ("a", "avg"), ("m", "max")) if _allows(dtype, red)]
        lines += [f"  input %{k}_{d} : {d}[{t}] {{x: {lay}}}" for k, lay in inputs]
        ax = 'axis="x"'
        op(f"%ag0h_{d}", f"comm.all_gather(%s0_{d}, {ax}, dim=0)", ["R"], d)
        op(f"%ag1_{d}", f"comm.all_gather(%s1_{d}, {ax}, dim=1)", ["R"], d)
        op(f"%a2a01_{d}", f"comm.all_to_all(%s0_{d}, {ax}, concat_dim=0, split_dim=1)", ["S(1)"], d)
        op(f"%a2a10_{d}", f"comm.all_to_all(%s1_{d}, {ax}, concat_dim=1, split_dim=0)", ["S(0)"], d)
        op(f"%shift_{d}", f"comm.ppermute(%s0_{d}, {ax}, dim=0, order={list(shift_order(n))})", ["S(0)"], d)
        op(f"%zigzag_{d}", f"comm.ppermute(%s0_{d}, {ax}, dim=0, order={list(zigzag_order(n))})", ["S(0)"], d)
        op(f"%agb0_{d}, %agb1_{d}", f"comm.all_gather_bucket(%s0_{d}, %s1_{d}, {ax}, dims=[0, 1])", ["R", "R"], d)
        op(f"%shard_{d}", f"comm.shard(%r_{d}, {ax}, dim=1)", ["S(1)"], d)
        op(f"%ag0_{d}", f"comm.wait(%ag0h_{d})", ["R"], d)
        outs += [f"ag0_{d}", f"ag1_{d}", f"a2a01_{d}", f"a2a10_{d}", f"shift_{d}", f"zigzag_{d}"]
        outs += [f"agb0_{d}", f"agb1_{d}", f"shard_{d}"]
        if _allows(dtype, "sum"):
            op(f"%ar_{d}", f'comm.all_reduce(%p_{d}, {ax}, reduce="sum")', ["R"], d)
            op(f"%rs0h_{d}", f'comm.reduce_scatter(%p_{d}, {ax}, dim=0, reduce="sum")', ["S(0)"], d)
            op(f"%rs1_{d}", f'comm.reduce_scatter(%p_{d}, {ax}, dim=1, reduce="sum")', ["S(1)"], d)
            op(f"%arb0_{d}, %arb1_{d}", f'comm.all_reduce_bucket(%p_{d}, %p_{d}, {ax}, reduce="sum")', ["R", "R"], d)
            call = f'comm.reduce_scatter_bucket(%p_{d}, %p_{d}, {ax}, dims=[0, 1], reduce="sum")'
            op(f"%rsb0h_{d}, %rsb1h_{d}", call, ["S(0)", "S(1)"], d)
            op(f"%partial_{d}", f'comm.partial(%r_{d}, {ax}, reduce="sum")', ["P(sum)"], d)
            op(f"%rs0_{d}", f"comm.wait(%rs0h_{d})", ["S(0)"], d)
            op(f"%rsb0_{d}, %rsb1_{d}", f"comm.wait(%rsb0h_{d}, %rsb1h_{d})", ["S(0)", "S(1)"], d)
            outs += [f"ar_{d}", f"rs0_{d}", f"rs1_{d}", f"arb0_{d}", f"arb1_{d}", f"rsb0_{d}", f"rsb1_{d}"]
            outs += [f"partial_{d}"]
        if _allows(dtype, "avg"):
            op(f"%avg_{d}", f'comm.all_reduce(%a_{d}, {ax}, reduce="avg")', ["R"], d)
            op(f"%avgs_{d}", f'comm.reduce_scatter(%a_{d}, {ax}, dim=1, reduce="avg")', ["S(1)"], d)
            call = f'comm.reduce_scatter_bucket(%a_{d}, %a_{d}, {ax}, dims=[1, 0], reduce="avg")'
            op(f"%avgb0_{d}, %avgb1_{d}", call, ["S(1)", "S(0)"], d)
            outs += [f"avg_{d}", f"avgs_{d}", f"avgb0_{d}", f"avgb1_{d}"]
        if _allows(dtype, "max"):
            op(f"%max_{d}", f'comm.all_reduce(%m_{d}, {ax}, reduce="max")', ["R"], d)
            op(f"%maxs_{d}", f'comm.reduce_scatter(%m_{d}, {ax}, dim=0, reduce="max")', ["S(0)"], d)
            outs += [f"max_{d}", f"maxs_{d}"]
    lines += ops + [f"  output out({k}) = %{k}" for k in outs] + ["}"]
    return "\n".join(lines) + "\n"


def _values(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``SHAPE`` and ``dtype`` of small integers (complex: small Gaussian integers), so
    every sum and mean of four of them is exact in every dtype."""
    gen = torch.Generator().manual_seed(seed)
    re, im = (torch.randint(-4, 5, SHAPE, generator=gen) for _ in range(2))
    if dtype == torch.bool:
        return re > 0
    if dtype.is_complex:
        return torch.complex(re.float(), im.float()).to(torch.complex128).to(dtype)
    return re.to(dtype)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in a dtype torch computes every reduction in (complex32 has almost no kernels)."""
    return x.to(torch.complex64) if x.dtype == torch.complex32 else x


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal values, shape and dtype (complex compared as their real views)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.is_complex:
        got, want = torch.view_as_real(got), torch.view_as_real(want)
    if is_float8(got.dtype):  # NOTE: float8 compares as its bytes
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    return torch.equal(got, want)


def _expected(names: tuple[str, ...], n: int, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's inputs and each output's expected value, by name (every rank draws every rank's
    operands alike: partial values per rank, split ones whole)."""
    inputs: dict[str, torch.Tensor] = {}
    want: dict[str, torch.Tensor] = {}
    for i, d in enumerate(names):
        dtype = DTYPES_BY_NAME[d]
        whole0, whole1, rep = (_values(dtype, 100 * i + k) for k in range(3))
        inputs |= {f"s0_{d}": whole0.chunk(n, 0)[rank], f"s1_{d}": whole1.chunk(n, 1)[rank], f"r_{d}": rep}
        want |= {f"ag0_{d}": whole0, f"ag1_{d}": whole1, f"agb0_{d}": whole0, f"agb1_{d}": whole1}
        want |= {f"a2a01_{d}": whole0.chunk(n, 1)[rank], f"a2a10_{d}": whole1.chunk(n, 0)[rank]}
        want |= {f"shift_{d}": permuted(whole0, 0, shift_order(n)).chunk(n, 0)[rank]}
        want |= {f"zigzag_{d}": permuted(whole0, 0, zigzag_order(n)).chunk(n, 0)[rank]}
        want[f"shard_{d}"] = rep.chunk(n, 1)[rank]
        for k, reduce in (("p", "sum"), ("a", "avg"), ("m", "max")):
            if not _allows(dtype, reduce):
                continue
            parts = [_values(dtype, 100 * i + 10 * (3 + "pam".index(k)) + r) for r in range(n)]
            inputs[f"{k}_{d}"] = parts[rank]
            wide = [_wide(p) for p in parts]
            if reduce == "max":
                full = functools.reduce(torch.maximum, wide).to(dtype)
                want |= {f"max_{d}": full, f"maxs_{d}": full.chunk(n, 0)[rank]}
            elif reduce == "avg":
                full = (sum(wide[1:], wide[0]) / n).to(dtype)
                want |= {f"avg_{d}": full, f"avgs_{d}": full.chunk(n, 1)[rank]}
                want |= {f"avgb0_{d}": full.chunk(n, 1)[rank], f"avgb1_{d}": full.chunk(n, 0)[rank]}
            else:
                full = sum(wide[1:], wide[0]).to(dtype)
                want |= {f"ar_{d}": full, f"arb0_{d}": full, f"arb1_{d}": full}
                want |= {f"rs0_{d}": full.chunk(n, 0)[rank], f"rs1_{d}": full.chunk(n, 1)[rank]}
                want |= {f"rsb0_{d}": full.chunk(n, 0)[rank], f"rsb1_{d}": full.chunk(n, 1)[rank]}
                want[f"partial_{d}"] = rep if rank == 0 else torch.zeros_like(rep)
    return inputs, want


def collectives(names: tuple[str, ...], backend: str, gloo: bool) -> dict[str, Any]:
    """Every comm op on values of each dtype in ``names`` (``_program``) over every rank, lowered by
    ``backends.eager`` in gloo's forms (``gloo``: all-gathers and sum reduce-scatters as all-to-alls)
    or the forms NCCL runs, run as it is (``backend="eager"``), compiled by Inductor or traced into the
    GE graph torchair converts (``"ascend"``, run as ATen ops on CPU): the outputs
    that differ from what the collective must give (their names), the outputs compared, and the inputs
    whose bytes on this rank ``ir.graph.local_nbytes`` counts otherwise than the tensor holds."""
    n, rank = dist.get_world_size(), dist.get_rank()
    graph = ir.parse(_program(names, n))
    ir.verify(graph)
    assert graph.mesh is not None
    group = dist.distributed_c10d._get_default_group().group_name
    ctx = RankContext(graph.mesh, (rank,), (group,), gloo=gloo)
    outputs = [o.value for o in graph.outputs]
    module = build_module([i.value for i in graph.inputs], graph.ops, outputs, ctx, torch.default_generator)
    inputs, want = _expected(names, n, rank)
    args = [inputs[i.name].contiguous() for i in graph.inputs]
    run: Callable[..., Any] = module
    if backend == "inductor":
        run = Compiled(plain(module, "backend='inductor' cannot compile", ""), f"rank {rank}'s collectives")
    elif backend == "ascend":  # NOTE: the GE graph torchair would convert, run on CPU (it needs no NPU)
        mode = FakeTensorMode(allow_non_fake_inputs=False)
        run = ascend.ge_module(module, [mode.from_tensor(x) for x in args], mode, f"rank {rank}'s collectives")
    got = run(*args)
    wrong = [o.name for o, x in zip(graph.outputs, got, strict=True) if not _same(x, want[o.name])]
    # NOTE: what the cost model and the memory estimate count each value as (complex64: 8 bytes an element)
    sized = [i.name for i, x in zip(graph.inputs, args, strict=True) if local_nbytes(i.value, graph.mesh) != x.nbytes]
    return {"wrong": wrong, "compared": sorted(o.name for o in graph.outputs), "missized": sized}


def point_to_point(names: tuple[str, ...]) -> list[str]:
    """Ring attention's point-to-point pass (``backends.context_parallel.p2p``), its zigzag reshuffle
    (``ring_lowering.to_zigzag``/``from_zigzag``) and the host tier's round trip (``backends.host_tier``)
    on values of each dtype in ``names``: the checks that fail (by name)."""
    pg = dist.distributed_c10d._get_default_group()
    n, rank = dist.get_world_size(), dist.get_rank()
    wrong = []
    for i, d in enumerate(names):
        dtype = DTYPES_BY_NAME[d]
        mine, theirs = _values(dtype, 1000 * i + rank), _values(dtype, 1000 * i + (rank - 1) % n)
        (got,) = p2p.finish(p2p.start(pg, [mine], (rank + 1) % n, (rank - 1) % n))
        if not _same(got, theirs):
            wrong.append(f"p2p_{d}")
        seq = _values(dtype, 7).reshape(1, 2, 48)  # NOTE: (batch, heads, sequence): 8 half-chunks of 6
        part = sequence_shard(seq, 2, n, rank, "contiguous")
        zig = to_zigzag(part, pg)
        if not _same(zig, sequence_shard(seq, 2, n, rank, "zigzag")) or not _same(from_zigzag(zig, pg), part):
            wrong.append(f"zigzag_{d}")
        if not _same(reload(offload(mine)), mine):
            wrong.append(f"offload_{d}")
    return wrong


def refused(name: str, reduce: str) -> dict[str, Any]:
    """A reduction ``reduce_refusal`` refuses, of a ``name`` value over every rank, in each comm op that
    reduces: the verifier's error and the eager lowering's for each, and whether the default group's
    collectives stayed where they were (none was issued)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    pg = dist.distributed_c10d._get_default_group()
    t = ", ".join(map(str, SHAPE))
    calls = [
        ("all_reduce", f'comm.all_reduce(%p, axis="x", reduce="{reduce}")', "R"),
        ("reduce_scatter", f'comm.reduce_scatter(%p, axis="x", dim=0, reduce="{reduce}")', "S(0)"),
        ("all_reduce_bucket", f'comm.all_reduce_bucket(%p, axis="x", reduce="{reduce}")', "R"),
        ("reduce_scatter_bucket", f'comm.reduce_scatter_bucket(%p, axis="x", dims=[1], reduce="{reduce}")', "S(1)"),
    ]
    before = pg._get_sequence_number_for_group()
    errors: dict[str, tuple[str, str]] = {}
    for kind, call, lay in calls:
        graph = ir.parse(
            f"graph @refused mesh<x={n}> {{\n  input %p : {name}[{t}] {{x: P({reduce})}}\n"
            f"  %q = {call} : {name}[{t}] {{x: {lay}}}  # layers.0.attn fwd\n  output out(q) = %q\n}}\n"
        )
        assert graph.mesh is not None
        try:
            ir.verify(graph)
            verified = ""
        except ir.VerifyError as e:
            verified = str(e)
        ctx = RankContext(graph.mesh, (rank,), (pg.group_name,), gloo=True)
        try:
            build_module([graph.inputs[0].value], graph.ops, [graph.outputs[0].value], ctx, torch.default_generator)
            lowered = ""
        except ValueError as e:
            lowered = str(e)
        errors[kind] = (verified, lowered)
    return {"errors": errors, "issued": pg._get_sequence_number_for_group() - before}
