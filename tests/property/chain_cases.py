"""Tasks that run on every rank of a 4-rank pool (a (2, 2) ``("dp", "tp")`` mesh): lower boxed chain
graphs for this rank, feed them this rank's piece of seeded global inputs, and compare with the
reference interpreter on the unsharded graph.

Every rank builds every rank's local inputs the same way (:func:`local_pieces`), so ``Partial`` parts
agree across ranks without any communication; a rank keeps its own.
"""

from __future__ import annotations

import itertools
import traceback
import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

import ir
from backends.eager import RankContext, lower
from backends.interpret import interpret
from ir import Layout, Mesh, Partial, Shard, TensorType
from tests.dist.pool import device_mesh
from tests.sharding_sim import split

RTOL, ATOL = 1e-4, 1e-5
SHAPE, NAMES = (2, 2), ("dp", "tp")
Coord = tuple[int, ...]


def global_inputs(graph: ir.Graph, seed: int) -> dict[str, torch.Tensor]:
    """Seeded standard-normal values for every non-tangent input, in input order."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in graph.inputs:
        t = i.value.type
        if i.kind != "tangent" and isinstance(t, TensorType):
            out[i.name] = torch.randn(tuple(int(d) for d in t.shape), generator=gen, dtype=t.dtype)
    return out


def local_pieces(x: torch.Tensor, layout: Layout, mesh: Mesh, seed: int) -> dict[Coord, torch.Tensor]:
    """Every rank's local value of global ``x`` held in ``layout``.

    ``Shard(d)`` chunks dim ``d`` per mesh axis, outer axis first; ``Partial(sum)`` splits the value
    into random parts that sum to it, one split per group of ranks along that axis.
    """
    coords = list(itertools.product(*(range(s) for s in mesh.sizes)))
    out: dict[Coord, torch.Tensor] = {}
    for c in coords:
        v = x
        for i, p in enumerate(layout.placements):
            if isinstance(p, Shard):
                v = v.chunk(mesh.sizes[i], p.dim)[c[i]]
        out[c] = v.contiguous()
    for i, p in enumerate(layout.placements):
        if not isinstance(p, Partial):
            continue
        assert p.reduce == "sum", f"inputs are only ever P(sum), not {p}"
        split_out: dict[Coord, torch.Tensor] = {}
        later = [j for j in range(i + 1, mesh.ndim) if isinstance(layout.placements[j], Partial)]
        for c in coords:
            # NOTE: the ranks of one group along axis i hold the same value here (axis i is not a
            # Shard). So do ranks differing only on later Partial axes (not split yet): they must
            # split it alike, so the seed ignores those coordinates too. Part k goes to rank k.
            key = tuple(0 if j == i or j in later else c[j] for j in range(mesh.ndim))
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
    :func:`local_pieces`): Partial axes are summed, Shard axes concatenated, inner axis first."""
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
                merged[c] = torch.stack(group).sum(0)
            else:
                merged[c] = group[0]
        vals = merged
    (value,) = vals.values()
    return value
