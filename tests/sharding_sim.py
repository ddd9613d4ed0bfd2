"""Simulated ranks in one process (EasyDist's ShardCombine): split real global values into each
rank's local values for a placement, run an op on every rank, and combine the local results back.

No process group is involved; a strategy is right when the combined results equal the op's
global results.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from meshfold.backends.local import LOCAL
from meshfold.ir import Layout, Mesh, Op, Partial, Placement, Replicate, Shard, TensorType, Value
from meshfold.ir.graph import Arg
from meshfold.passes.sharding.strategy import Strategy


def is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.dtype.is_floating_point or x.dtype.is_complex)


def runnable(op: Op, s: Strategy, n: int) -> bool:
    """Every shard divides its dim by ``n`` and every Partial sits on a float tensor."""
    for v, p in zip((*op.operands, *op.results), (*s.inputs, *s.outputs), strict=True):
        t = v.type
        if not isinstance(t, TensorType):
            continue
        if isinstance(p, Shard) and int(t.shape[p.dim]) % n:
            return False
        if isinstance(p, Partial) and not (t.dtype.is_floating_point or t.dtype.is_complex):
            return False
    return True


def split(x: Any, p: Placement, n: int, gen: torch.Generator) -> list[Any]:
    """The ``n`` local values of global ``x`` placed ``p``.

    ``Partial(sum)``: random parts summing to ``x``; ``Partial(avg)``: parts averaging to it;
    ``Partial(max)``: ``x`` on one rank, strictly smaller values on the others.
    """
    if not isinstance(x, torch.Tensor) or isinstance(p, Replicate):
        return [x for _ in range(n)]
    if isinstance(p, Shard):
        return [c.contiguous() for c in x.chunk(n, p.dim)]
    # NOTE: parts differ from x/n by noise proportional to each element (so huge values such as a
    # dtype's min do not overflow and tiny ones keep their precision); non-finite elements are copied.
    finite = torch.isfinite(x)
    mag = torch.where(finite, x.abs(), torch.zeros_like(x))
    noise = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype) for _ in range(n)]
    if p.reduce == "max":
        owner = int(torch.randint(n, (1,), generator=gen))
        return [x if r == owner else x - mag * (0.1 + noise[r].abs()) - 1e-3 for r in range(n)]
    centre = sum(noise, torch.zeros_like(x)) / n
    share = x / n if p.reduce == "sum" else x
    parts = [torch.where(finite, share + (noise[r] - centre) * mag * (0.5 / n), x) for r in range(n)]
    return parts


def combine(parts: Sequence[Any], p: Placement) -> Any:
    """The global value the ranks' ``parts`` represent under placement ``p``."""
    first = parts[0]
    if not isinstance(first, torch.Tensor):
        return first
    if isinstance(p, Shard):
        return torch.cat(list(parts), p.dim)
    if isinstance(p, Replicate):
        for r, other in enumerate(parts[1:], 1):
            torch.testing.assert_close(other, first, rtol=1e-4, atol=1e-5, msg=lambda m, r=r: f"rank {r} differs: {m}")
        return first
    stacked = torch.stack(list(parts))
    if p.reduce == "sum":
        return stacked.sum(0)
    if p.reduce == "avg":
        return stacked.mean(0)
    return stacked.amax(0)


def local_inputs(
    operands: Sequence[Any], placements: Sequence[Placement], n: int, gen: torch.Generator
) -> list[list[Any]]:
    """Each rank's operands (``result[r][i]``) from the global ``operands`` and their placements."""
    per_operand = [split(x, p, n, gen) for x, p in zip(operands, placements, strict=True)]
    return [[vals[r] for vals in per_operand] for r in range(n)]


def _fill(arg: Arg, it: Iterator[Any]) -> Any:
    """``arg`` with each value replaced by the next local operand (lists where the call wants them)."""
    if isinstance(arg, Value):
        return next(it)
    if isinstance(arg, tuple):
        return [_fill(a, it) for a in arg]
    return arg


def run_on_ranks(op: Op, s: Strategy, operands: Sequence[Any], n: int, gen: torch.Generator) -> list[Any]:
    """Run ``op`` on ``n`` simulated ranks under strategy ``s`` and return its combined results
    (None for non-tensor results). ``operands`` are global values in ``op.operands`` order. Each
    rank computes as the backends do (``backends.local``: localized arguments, ranged slices)."""
    ranks = local_inputs(operands, s.inputs, n, gen)
    mesh = Mesh.of(sim=n)
    layouts = [Layout(mesh.names, (p,)) for p in (*s.inputs, *s.outputs)]
    args, kwargs = LOCAL.local_args(op, mesh, layouts[len(op.operands) :])
    per_rank: list[list[Any]] = []
    for r in range(n):
        it = iter(ranks[r])
        call_args = [_fill(a, it) for a in args]
        call_kwargs = {k: _fill(v, it) for k, v in kwargs.items()}
        bounds = LOCAL.slice_of(op, mesh, (r,), layouts)
        if bounds is not None:
            out = LOCAL.ranged[op.target].impl(*bounds, *call_args, **call_kwargs)
        else:
            out = op.target(*call_args, **call_kwargs)  # type: ignore[operator]
        per_rank.append(list(out) if isinstance(out, (tuple, list)) else [out])
    combined = []
    for j, (res, p) in enumerate(zip(op.results, s.outputs, strict=True)):
        parts = [outs[j] for outs in per_rank]
        combined.append(combine(parts, p) if isinstance(res.type, TensorType) else None)
    return combined


def check_strategy(op: Op, s: Strategy, env: dict[Value, Any], n: int, gen: torch.Generator) -> None:
    """Assert the combined per-rank results of ``op`` under ``s`` equal its global results."""
    got = run_on_ranks(op, s, [env[v] for v in op.operands], n, gen)
    for res, value in zip(op.results, got, strict=True):
        if value is None:
            continue
        want = env[res]
        exact = not is_float(want)
        torch.testing.assert_close(
            value,
            want,
            rtol=0 if exact else 1e-4,
            atol=0 if exact else 1e-5,
            equal_nan=True,
            msg=lambda m: f"{op.describe()} under {s} on {n} ranks: {m}",
        )
