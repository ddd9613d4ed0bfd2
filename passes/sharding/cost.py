"""The size the sharding passes count a tensor in: its bytes.

No time here: every time (the solve's, the greedy choice's, the simulator's) comes from the one
time model in ``passes/cost`` (``passes.cost.axis`` for a mesh axis); wire volumes of the
collectives are the ``comm.*`` op definitions' (``ir.ops``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.ir import TensorType
from meshfold.ir.symbolic import size_hint

if TYPE_CHECKING:
    from meshfold.passes.cost.axis import AxisModel
    from meshfold.passes.sharding.strategy import Strategy


def nbytes(t: TensorType) -> float:
    """Bytes of a tensor of type ``t`` (its global shape)."""
    n = 1
    for d in t.shape:
        n *= size_hint(d)
    return float(n * t.dtype.itemsize)


def own_traffic(model: AxisModel, s: Strategy, shrink: int = 1, compute: float = 0.0) -> float:
    """Seconds of the traffic an op makes itself under strategy ``s`` on ``model``'s axis, of the
    ``1/shrink`` part the earlier axes left it: the all-to-all dispatcher's (each rank sends its
    ``1/n`` share of ``s.exchange``) and what ring attention passes beyond the ``compute`` seconds
    it overlaps (``s.passed``: an all-gather's volume, sent while the blocks compute), and a scan's
    all-gather of each rank's state (``s.state``)."""
    if model.size <= 1:
        return 0.0
    t = model.collective("all_to_all", s.exchange / model.size / shrink) if s.exchange else 0.0
    if s.passed:
        t += max(0.0, model.collective("all_gather", s.passed / shrink) - compute)
    if s.state:
        t += model.collective("all_gather", s.state * model.size / shrink)
    return t
