"""Tasks that run on every rank of a 4-rank pool (a (2, 2) ``("dp", "tp")`` mesh): lower boxed chain
graphs for this rank, feed them this rank's piece of seeded global inputs, and compare with the
reference interpreter on the unsharded graph.

Every rank builds every rank's local inputs the same way (:func:`local_pieces`), so ``Partial`` parts
agree across ranks without any communication; a rank keeps its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import traceback
import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from meshfold import ir
from meshfold.backends.eager import RankContext, lower
from meshfold.backends.interpret import interpret
from meshfold.ir import Layout, Mesh, Partial, Shard, TensorType
from meshfold.tools.pool_worker import device_mesh
from tests.sharding_sim import split

RTOL, ATOL = 1e-4, 1e-5
SHAPE, NAMES = (2, 2), ("dp", "tp")
Coord = tuple[int, ...]


def global_inputs(graph: ir.Graph, seed: int) -> dict[str, torch.Tensor]:
    """Seeded standard-normal values for every input, in input order.

    NOTE: a tangent is divided by the square root of its size, so gradients stay O(1) however large
    the output is (with all-ones tangents they grow with it, and so does fp32 rounding).
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in graph.inputs:
        t = i.value.type
        if isinstance(t, TensorType):
            x = torch.randn(tuple(int(d) for d in t.shape), generator=gen, dtype=t.dtype)
            out[i.name] = x / max(x.numel(), 1) ** 0.5 if i.kind == "tangent" else x
    return out


def joint_inputs(graph: ir.Graph, seed: int) -> dict[str, torch.Tensor]:
    """:func:`global_inputs` with each tangent ``tangent.i`` laid out in memory like ``out(i)``.

    NOTE: AOTAutograd traces the backward with tangents strided like the forward's outputs, so a
    captured backward may ``view`` a tangent in a way only those strides allow; the reference
    interpreter runs views as views, so its tangents must have them.
    """
    values = global_inputs(graph, seed)
    fwd_ops = tuple(op for op in graph.ops if op.prov.phase == "fwd")
    outs = tuple(o for o in graph.outputs if o.kind == "out")
    forward = dataclasses.replace(graph, inputs=tuple(i for i in graph.inputs if i.kind != "tangent"))
    got = interpret(dataclasses.replace(forward, ops=fwd_ops, outputs=outs), values)
    for i in graph.inputs:
        if i.kind == "tangent":
            like = got[("out", i.name.removeprefix("tangent."))]
            values[i.name] = torch.empty_like(like).copy_(values[i.name])
    return values


def local_pieces(x: torch.Tensor, layout: Layout, mesh: Mesh, seed: int) -> dict[Coord, torch.Tensor]:
    """Every rank's local value of global ``x`` held in ``layout``.

    ``Shard(d)`` chunks dim ``d`` per mesh axis, outer axis first; ``Partial(sum)`` splits the value
    into random parts that sum to it, one split per group of ranks along that axis.
    """
    coords = list(itertools.product(*(range(s) for s in mesh.sizes)))
    out: dict[Coord, torch.Tensor] = {}
    for c in coords:
        v = x
        for d, (lo, size) in enumerate(layout.shard_bounds(x.shape, mesh, c)):
            v = v.narrow(d, lo, size)
        out[c] = v.contiguous()
    for i, p in enumerate(layout.placements):
        if not isinstance(p, Partial):
            continue
        assert p.reduce == "sum", f"inputs are only ever P(sum), not {p}"
        split_out: dict[Coord, torch.Tensor] = {}
        # NOTE: ranks hold the same value here unless they differ on a Shard axis or on a Partial
        # axis split before this one; ranks holding the same value must split it alike, so only
        # those coordinates pick the seed. Part k goes to the rank with coordinate k on axis i.
        differs = [
            j for j, q in enumerate(layout.placements) if isinstance(q, Shard) or (isinstance(q, Partial) and j < i)
        ]
        for c in coords:
            key = tuple(c[j] if j in differs else 0 for j in range(mesh.ndim))
            gen = torch.Generator().manual_seed(hash((seed, i, key)) % 2**63)
            split_out[c] = split(out[c], p, mesh.sizes[i], gen)[c[i]]
        out = split_out
    return out


def _rank_context() -> tuple[RankContext, Mesh]:
    mesh = device_mesh(SHAPE, NAMES)
    imesh = Mesh(NAMES, SHAPE)
    coord = mesh.get_coordinate()
    assert coord is not None
    groups = tuple(mesh.get_group(i).group_name for i in range(mesh.ndim))
    return RankContext(imesh, tuple(coord), groups), imesh


def _one_chain(text: str, boxed_text: str, seed: int, rank: RankContext) -> str | None:
    """Run one boxed chain on this rank; None when out(0) matches the interpreter, else why not."""
    graph, boxed = ir.parse(text), ir.parse(boxed_text)
    glob = global_inputs(graph, seed)
    lowered = lower(boxed, rank)
    local = [
        local_pieces(glob[name], boxed.input(name).value.layout, rank.mesh, seed + k)[rank.coordinate]
        for k, name in enumerate(lowered.fwd_inputs)
    ]
    got = lowered.forward(*local)[0]
    want = interpret(graph, glob)[("out", "0")]
    try:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, equal_nan=True)
    except AssertionError as e:
        return f"rank {rank.coordinate}: out(0) differs from the interpreter: {e}"
    return None


def run_chains(examples: Sequence[tuple[str, str, int]]) -> list[str | None]:
    """For each ``(graph text, boxed graph text, seed)``: None if this rank's out(0) equals the reference,
    else the error (a traceback or the mismatch).

    NOTE: after every example the ranks agree (one all-reduce) on whether any of them failed, so a
    failure on some ranks is reported by all and the collectives of later examples stay matched.
    """
    warnings.filterwarnings("ignore")
    rank, _ = _rank_context()
    results: list[str | None] = []
    for text, boxed_text, seed in examples:
        try:
            error = _one_chain(text, boxed_text, seed, rank)
        except Exception:
            error = f"rank {rank.coordinate}: {traceback.format_exc()}"
        flag = torch.tensor([0.0 if error is None else 1.0])
        dist.all_reduce(flag)
        if error is None and flag.item() > 0:
            error = f"rank {rank.coordinate}: passed here, failed on another rank"
        results.append(error)
    return results


def combine(parts: Mapping[Coord, torch.Tensor], layout: Layout, mesh: Mesh) -> torch.Tensor:
    """The global value the ranks' local ``parts`` represent in ``layout`` (the inverse of
    :func:`local_pieces`): Partial axes are summed, Shard axes concatenated, inner axis first.
    Raises ``AssertionError`` when the ranks of a Replicate group disagree."""
    vals = dict(parts)
    for i in reversed(range(mesh.ndim)):
        p = layout.placements[i]
        merged: dict[Coord, torch.Tensor] = {}
        for c in vals:
            if c[i] != 0:
                continue
            group = [vals[(*c[:i], k, *c[i + 1 :])] for k in range(mesh.sizes[i])]
            if isinstance(p, Shard):
                merged[c] = torch.cat(group, p.dim)
            elif isinstance(p, Partial):
                assert p.reduce == "sum", f"cannot combine {p}"
                merged[c] = torch.stack(group).sum(0)
            else:
                for k, other in enumerate(group[1:], 1):
                    where = f"Replicate over mesh axis {mesh.names[i]}: rank {(*c[:i], k, *c[i + 1 :])} vs {c}"
                    torch.testing.assert_close(
                        other, group[0], rtol=RTOL, atol=ATOL, msg=lambda m, w=where: f"{w}: {m}"
                    )
                merged[c] = group[0]
        vals = merged
    (value,) = vals.values()
    return value


def _one_joint(text: str, boxed_text: str, seed: int, rank: RankContext) -> dict[str, torch.Tensor]:
    """Run one boxed joint graph's forward and backward on this rank; its out(0) and local gradients."""
    graph, boxed = ir.parse(text), ir.parse(boxed_text)
    # NOTE: the lowering runs views as reshapes, so tangents need only the right values here.
    glob = global_inputs(graph, seed)
    lowered = lower(boxed, rank)
    local = [
        local_pieces(glob[name], boxed.input(name).value.layout, rank.mesh, seed + k)[rank.coordinate]
        for k, name in enumerate(lowered.fwd_inputs)
    ]
    outs = lowered.forward(*local)
    n_out = len(lowered.fwd_outputs)
    tangents = [
        local_pieces(glob[name], boxed.input(name).value.layout, rank.mesh, seed)[rank.coordinate]
        for name in lowered.bwd_inputs
    ]
    grads = lowered.backward(*outs[n_out:], *tangents)
    result = {"out": outs[lowered.fwd_outputs.index(("out", "0"))]}
    result.update({f"grad({n})": g for n, g in zip(lowered.bwd_outputs, grads, strict=True)})
    return result


def _check_joint(text: str, boxed_text: str, seed: int, pieces: Sequence[dict[str, torch.Tensor]]) -> str | None:
    """Combine every rank's results by the boxed graph's output layouts; compare with the interpreter."""
    graph, boxed = ir.parse(text), ir.parse(boxed_text)
    want = interpret(graph, joint_inputs(graph, seed))
    mesh = Mesh(NAMES, SHAPE)
    coords = list(itertools.product(*(range(s) for s in SHAPE)))
    for o in boxed.outputs:
        key = "out" if o.kind == "out" else f"grad({o.name})"
        if o.kind == "out" and o.name != "0":
            continue
        try:
            got = combine({c: p[key] for c, p in zip(coords, pieces, strict=True)}, o.value.layout, mesh)
            torch.testing.assert_close(got, want[(o.kind, o.name)], rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError as e:
            return f"{o.kind}({o.name}) in layout {o.value.layout} differs from the interpreter: {e}"
    return None


def run_joints(examples: Sequence[tuple[str, str, int]]) -> list[str | None]:
    """For each ``(joint graph text, boxed text, seed)``: None if out(0) and every gradient, combined
    from all ranks by their layouts, equal the interpreter's on the unsharded joint graph; else why not.

    Rank 0 gathers every rank's results and judges them; the other ranks return an empty list.
    """
    warnings.filterwarnings("ignore")
    rank, _ = _rank_context()
    first = dist.get_rank() == 0
    results: list[str | None] = []
    for text, boxed_text, seed in examples:
        try:
            mine: dict[str, torch.Tensor] | str = _one_joint(text, boxed_text, seed, rank)
        except Exception:
            mine = f"rank {rank.coordinate}: {traceback.format_exc()}"
        pieces: list[dict[str, torch.Tensor] | str] | None = (
            [{} for _ in range(dist.get_world_size())] if first else None
        )
        dist.gather_object(mine, pieces, dst=0)
        if pieces is None:
            continue
        failed = [p for p in pieces if isinstance(p, str)]
        if failed:
            results.append(failed[0])
            continue
        try:
            results.append(_check_joint(text, boxed_text, seed, pieces))  # type: ignore[arg-type]
        except Exception:
            results.append(traceback.format_exc())
    return results
