"""Linear recurrences (``meshfold.affine_scan`` and its backward; see ``ir.dialects.scan``).

``affine_scan(m [*, n, k, k], b [*, n, k, v], s0 [*, k, v]) -> h [*, n, k, v]``: the leading dims
ride along on every tensor, and so do the state's columns ``v`` (each column of the state evolves by
the same ``m`` on its own: ``m`` whole, no traffic). The steps ``n`` split over an axis: each rank
scans its own steps after one all-gather of every rank's composite step (``k x (k + v)`` numbers
per leading index; ``backends/context_parallel/split_scans.py``). The state's rows ``k`` are mixed by ``m`` and
stay whole.
The backward is linear in the incoming gradient; with the steps split, ``ds0`` is the first rank's
(zero on the others): ``P(sum)``. A diagonal scan (``m [*, n, k, v]`` scaling each state entry)
mixes nothing: its ``k`` rides along too.
"""

from __future__ import annotations

from meshfold.ir import Op, Partial, R, Shard, TensorType
from meshfold.ir.dialects.scan import SCAN, SCAN_BACKWARD
from meshfold.passes.sharding.cost import nbytes
from meshfold.passes.sharding.rules.operands import einsum_of, letters, op_arg
from meshfold.passes.sharding.rules.table import RuleSet
from meshfold.passes.sharding.strategy import Strategy, einsum_strategies

RULES = RuleSet("scan")
P = Partial("sum")


def _shapes(op: Op) -> tuple[TensorType, int]:
    """The type of ``m`` and the position of the steps' dim."""
    m = op.operands[0].type
    assert isinstance(m, TensorType) and m.rank >= 3, f"{op.describe()}: m must be [*, n, k, k]"
    return m, m.rank - 3


def _state_bytes(op: Op) -> float:
    """Bytes of one rank's composite step: ``[*, k, k + v]`` (``m``'s and the state's per step)."""
    m, d = _shapes(op)
    state = op.results[0].type if op.target == SCAN else op.operands[1].type
    assert isinstance(state, TensorType)
    n = int(m.shape[d])
    return (nbytes(m) + nbytes(state)) / max(n, 1)


@RULES.rule(SCAN)
def affine_scan(op: Op) -> list[Strategy]:
    """``L _ _ _, L _ _ v, L _ v -> L _ _ v`` (diagonal: ``L _ k v, L _ k v, L k v -> L _ k v``); and
    the steps split (module docstring)."""
    _, d = _shapes(op)
    lead, k = letters(d, skip="kv"), "k" if op_arg(op, "diagonal", False) else "_"
    cols = [*lead, "_", k, "v"]
    out = einsum_strategies(einsum_of([[*lead, "_", k, "v" if k == "k" else "_"], cols, [*lead, k, "v"]], [cols]))
    return [*out, Strategy((Shard(d), Shard(d), R), (Shard(d),), state=_state_bytes(op))]


@RULES.rule(SCAN_BACKWARD)
def affine_scan_backward(op: Op) -> list[Strategy]:
    """``(m, h, grad) -> (dm, db, ds0)``: ``L _ _ _, L _ _ v, L _ _ v -> L _ _ _, L _ _ v, L _ v``
    (``dm`` sums over ``v``: ``P(sum)``; diagonal: ``k`` and ``v`` ride along everywhere); linear in
    ``grad``; the steps split."""
    _, d = _shapes(op)
    lead, k = letters(d, skip="kv"), "k" if op_arg(op, "diagonal", False) else "_"
    m, cols = [*lead, "_", k, "v" if k == "k" else "_"], [*lead, "_", k, "v"]
    out = einsum_strategies(einsum_of([m, cols, cols], [m, cols, [*lead, k, "v"]]), linear=(2,))
    split = Strategy((Shard(d),) * 3, (Shard(d), Shard(d), P), state=_state_bytes(op))
    return [*out, split]
