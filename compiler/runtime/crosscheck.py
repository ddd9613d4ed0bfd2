"""``parallelize(..., verify=True)``: on the first step, check every value every rank computes
against the single-device model, and name the first one that differs.

The reference is the compiled graph itself run on whole tensors (its types are global and every
``comm.*`` op is the identity there), so each IR value has a global reference; a rank compares its
local value with its chunk of that reference (Partial values are reduced over their axes first).
All ranks agree on the first mismatch through one all-reduce, so they raise the same error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshfold import ir
from meshfold.backends.eager import RankContext
from meshfold.backends.interpret import run_values
from meshfold.runtime.signature import collective_device

_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class VerificationError(RuntimeError):
    """A compiled value differs from the single-device model's."""


class Verifier:
    """Holds the single-device reference of every value of one step and checks ranks against it."""

    def __init__(self, graph: ir.Graph, mesh: DeviceMesh, rank: RankContext, feeds: Mapping[str, torch.Tensor]) -> None:
        self.graph, self.mesh, self.rank = graph, mesh, rank
        self.reference = run_values(graph, feeds, global_view=True)
        self.producers = graph.producers()

    def check(self, values: Sequence[ir.Value], local: Sequence[torch.Tensor], phase: str) -> None:
        """Compare this rank's ``local`` tensors for ``values``; raise naming the first difference.
        Collective: every rank checks the same ``values``."""
        details = self._details(values, local)
        flags = torch.tensor([float(bool(d)) for d in details] + [0.0], device=collective_device())
        dist.all_reduce(flags, dist.ReduceOp.MAX)
        said = flags.tolist()
        bad = [k for k in range(len(values)) if said[k] > 0]
        if bad:
            k = bad[0]
            mine = details[k] or "this rank's value agrees; another rank's differs"
            raise VerificationError(self._message(values[k], phase, mine, f"{len(bad)} of {len(values)}"))

    def check_stages(self, recorded: Sequence[tuple[Sequence[ir.Value], Sequence[torch.Tensor], str]]) -> None:
        """``check`` for ranks that compute different values (the stages of a pipeline): each rank
        compares its own ``(values, local tensors, phase)`` groups, then all agree on the difference
        earliest in the program and raise it alike. Collective over the world."""
        order = {op: i for i, op in enumerate(self.graph.ops)}
        mine: tuple[int, str] | None = None
        for values, local, phase in recorded:
            details = self._details(values, local)
            bad = [k for k, d in enumerate(details) if d]
            if bad:
                v = values[bad[0]]
                where = order[self.producers[v]]
                if mine is None or where < mine[0]:
                    count = f"{len(bad)} of this stage's {len(values)}"
                    mine = (where, self._message(v, phase, details[bad[0]], count))
        found: list[tuple[int, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        first = min((f for f in found if f is not None), default=None)
        if first is not None:
            raise VerificationError(first[1])

    def _details(self, values: Sequence[ir.Value], local: Sequence[torch.Tensor]) -> list[str]:
        """Per value, how this rank's tensor differs from its piece of the reference ("" if it agrees)."""
        details: list[str] = []
        for v, t in zip(values, local, strict=True):
            got = self._reduce_partials(v, t.detach())
            want = self._local_chunk(v, self.reference[v])
            ok = got.shape == want.shape and torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-5)
            details.append("" if ok else self._diff(got, want))
        return details

    def _message(self, v: ir.Value, phase: str, detail: str, count: str) -> str:
        op = self.producers[v]
        operands = ", ".join(f"%{u.name} {u.layout}" for u in op.operands)
        return (
            f"{phase}: the first value that differs from the single-device model is %{v.name} : {v.type} "
            f"{v.layout}, computed by {op.describe()} from ({operands}); {detail}. {count} {phase} values differ."
        )

    def _reduce_partials(self, v: ir.Value, t: torch.Tensor) -> torch.Tensor:
        for i, p in enumerate(v.layout.placements):
            if isinstance(p, ir.Partial):
                t = t.clone()
                dist.all_reduce(t, _REDUCE[p.reduce], group=self.mesh.get_group(i))
                if p.reduce == "avg":
                    t = t / self.mesh.size(i)
        return t

    def _local_chunk(self, v: ir.Value, t: Any) -> torch.Tensor:
        """This rank's piece of the global reference ``t`` of ``v`` (``Layout.shard_bounds``)."""
        assert isinstance(t, torch.Tensor)
        for d, (lo, size) in enumerate(v.layout.shard_bounds(t.shape, self.rank.mesh, self.rank.coordinate)):
            t = t.narrow(d, lo, size)
        return t

    @staticmethod
    def _diff(got: torch.Tensor, want: torch.Tensor) -> str:
        if got.shape != want.shape:
            return f"local shape {tuple(got.shape)} instead of {tuple(want.shape)}"
        err = (got.double() - want.double()).abs()
        where = tuple(int(i) for i in torch.nonzero(err == err.max())[0])
        return f"largest difference {float(err.max()):.3g} at local index {where}"
