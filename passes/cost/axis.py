"""Time of one mesh axis's work, as the sharding solve prices it: the catalog device's roofline
(``opcost.roofline``) and the collective model (``comm.collective_time``) on the group the axis's
ranks form (``comm.place_axis``), exactly as the cluster simulator prices the same collective.

Nothing here is a model of its own: this module only says which collective a change of layout on
one axis is, and on which group of the cluster it runs. Without a cluster the ranks are gloo
processes on this CPU (``hardware.local_cluster``). Imported by name (it reads ``ir`` placements,
hence torch), like ``passes.cost.liveness``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshfold.ir import Mesh, Partial, Placement, Replicate, Shard
from meshfold.passes.cost import comm, opcost
from meshfold.passes.cost.comm import Group
from meshfold.target.hardware import Cluster, local_cluster

# NOTE: a local slice of a replicated value (or keeping a Partial on one rank) moves nothing; a
# token time keeps Replicate preferred when all else is equal.
SLICE_S = 1e-9


@dataclass(frozen=True, slots=True)
class AxisModel:
    """One mesh axis on ``cluster``: its ranks form ``group``; kernels run in ``dtype``."""

    cluster: Cluster
    group: Group
    dtype: str
    _moves: dict[tuple[Placement, Placement, float], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """``redistribute``'s answers: the solve asks the same few moves of every layer's values."""

    @property
    def size(self) -> int:
        """Ranks on the axis."""
        return self.group.size

    def compute(self, flops: float, nbytes: float) -> float:
        """Seconds of one kernel doing ``flops`` and moving ``nbytes`` on one device: the roofline
        without reduction-depth or wave factors (the solve sees ops, not their tiles)."""
        return opcost.roofline(self.cluster.device, flops, nbytes, None, self.dtype)

    def collective(self, kind: str, nbytes: float) -> float:
        """Seconds of collective ``kind`` (``comm.KINDS``) over the axis; ``nbytes`` as in ``comm``:
        the full buffer (gathered output, reduced input, everything one rank sends all-to-all)."""
        return comm.collective_time(kind, self.cluster, self.group, nbytes)

    def redistribute(self, src: Placement, dst: Placement, nbytes: float) -> float:
        """Seconds to turn a value whose whole extent on this axis is ``nbytes`` from ``src`` into
        ``dst``: Shard → Replicate (or → Partial, gathered first) an all-gather, Shard(i) →
        Shard(j) an all-to-all of each rank's shard, Partial → Shard a reduce-scatter, Partial →
        Replicate an all-reduce; from Replicate a local slice (``SLICE_S``)."""
        key = (src, dst, nbytes)
        hit = self._moves.get(key)
        if hit is None:
            hit = self._moves[key] = self._redistribute(src, dst, nbytes)
        return hit

    def greedy_move(self, src: Placement, dst: Placement, nbytes: float) -> float:
        """``redistribute`` as a choice that sees only its operands prices it (the greedy layout
        choice): Replicate → Partial, which moves nothing now, is priced as the reduction some later
        consumer must pay (the solve prices that reduction where it happens)."""
        if not isinstance(src, (Shard, Partial)) and isinstance(dst, Partial):
            return self.redistribute(dst, src, nbytes)
        return self.redistribute(src, dst, nbytes)

    def _redistribute(self, src: Placement, dst: Placement, nbytes: float) -> float:
        if self.size <= 1 or src == dst:
            return 0.0
        if isinstance(src, Replicate):
            return SLICE_S
        if isinstance(src, Shard):
            if isinstance(dst, Shard):
                return self.collective("all_to_all", nbytes / self.size)
            return self.collective("all_gather", nbytes)
        if isinstance(dst, Shard):
            return self.collective("reduce_scatter", nbytes)
        return self.collective("all_reduce", nbytes)


def axis_models(mesh: Mesh, cluster: Cluster | None, dtype: str = "fp32") -> tuple[AxisModel, ...]:
    """One ``AxisModel`` per mesh axis, in mesh order. Ranks fill nodes in mesh order with the LAST
    axis innermost (``comm.place_axis``). ``cluster`` None: gloo ranks on this CPU. ``dtype`` falls
    back to bf16 (then the device's first dtype) where the device publishes no peak for it."""
    if cluster is None:
        cluster = local_cluster(math.prod(mesh.sizes))
    have = cluster.device.dtypes
    kind = dtype if dtype in have else "bf16" if "bf16" in have else have[0]
    inner_first = list(reversed(list(zip(mesh.names, mesh.sizes, strict=True))))
    return tuple(AxisModel(cluster, comm.place_axis(cluster, inner_first, a), kind) for a in mesh.names)
