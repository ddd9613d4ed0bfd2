"""Redistribution cost on one mesh axis, in bytes on the wire per rank (ring algorithms).

Only relative sizes matter to the greedy choice; the full cost model lives in passes/cost/.
"""

from __future__ import annotations

import math

from meshfold.ir import Partial, Placement, Replicate, Shard, TensorType

# NOTE: slicing a replicated value is free of communication but not of consequence (it commits
# the value to a sharding); a tiny cost keeps Replicate preferred when all else is equal.
LOCAL_SLICE = 1e-3
IMPOSSIBLE = math.inf


def nbytes(t: TensorType) -> float:
    n = 1
    for d in t.shape:
        n *= int(d)
    return float(n * t.dtype.itemsize)


def transition_cost(src: Placement, dst: Placement, size: float, n: int) -> float:
    """Cost of turning placement ``src`` into ``dst`` on an axis of ``n`` ranks for ``size`` bytes."""
    if src == dst or n == 1:
        return 0.0
    frac = (n - 1) / n
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return size * frac
        if isinstance(dst, Shard):
            return size * frac / n
        return size * frac + LOCAL_SLICE  # gather, then keep a partial
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return 2 * size * frac
        if isinstance(dst, Shard):
            return size * frac
        return 2 * size * frac + LOCAL_SLICE
    if isinstance(dst, Partial):
        # NOTE: Replicate → Partial moves nothing now but defers a reduction that some consumer
        # must pay later (often several, one per consumer); priced like that reduction.
        return 2 * size * frac
    return LOCAL_SLICE  # Replicate → Shard is a local slice


def comm_volume(op_name: str, local_bytes: float, n: int) -> float:
    """Bytes one rank sends for a lowered collective whose operand is ``local_bytes`` on that rank."""
    frac = (n - 1) / n
    op_name = op_name.removesuffix("_bucket")
    if op_name == "comm.all_gather":
        return local_bytes * (n - 1)
    if op_name == "comm.all_reduce":
        return 2 * local_bytes * frac
    if op_name in ("comm.reduce_scatter", "comm.all_to_all"):
        return local_bytes * frac
    return 0.0
