"""The size the sharding passes count a tensor in: its bytes.

No time here: every time (the solve's, the greedy choice's, the simulator's) comes from the one
time model in ``passes/cost`` (``passes.cost.axis`` for a mesh axis); wire volumes of the
collectives are the ``comm.*`` op definitions' (``ir.ops``).
"""

from __future__ import annotations

from meshfold.ir import TensorType
from meshfold.ir.symbolic import size_hint


def nbytes(t: TensorType) -> float:
    """Bytes of a tensor of type ``t`` (its global shape)."""
    n = 1
    for d in t.shape:
        n *= size_hint(d)
    return float(n * t.dtype.itemsize)
