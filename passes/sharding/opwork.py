"""How much work an op is on one device: FLOPs (torch's flop formulas) and bytes read plus written.

The solver turns these into time with a roofline; only the ratio between strategies of one op
and between compute and communication matters there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.flop_counter import flop_registry

from meshfold.ir import Op, Target, TensorType, Value
from meshfold.ir.dialects.constant import CONSTANT
from meshfold.ir.dialects.conv import CONV, CONV_BACKWARD
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.ir.dialects.ring import LSE_MERGE, RING_STEP, RING_STEP_BACKWARD, step_area
from meshfold.ir.dialects.scan import SCAN, SCAN_BACKWARD
from meshfold.ir.graph import Arg
from meshfold.ir.symbolic import size_hint


def _numel(t: TensorType) -> int:
    n = 1
    for d in t.shape:
        n *= size_hint(d)
    return n


def op_bytes(op: Op) -> float:
    """Bytes of every tensor operand and result (global shapes)."""
    total = 0
    for v in (*op.operands, *op.results):
        if isinstance(v.type, TensorType):
            total += _numel(v.type) * v.type.dtype.itemsize
    return float(total)


def _shaped(a: Arg) -> Any:
    if isinstance(a, Value):
        return tuple(size_hint(d) for d in a.type.shape) if isinstance(a.type, TensorType) else None
    if isinstance(a, tuple):
        return [_shaped(x) for x in a]
    return a


def op_flops(op: Op) -> float:
    """FLOPs of ``op`` on the whole (unsharded) tensors: torch's formula where it has one, an
    attention estimate for the CPU attention kernels it lacks, else 0 (the op is memory-bound)."""
    packet = getattr(op.target, "overloadpacket", None)
    fn = flop_registry.get(packet) if packet is not None else None
    results = [r for r in op.results if isinstance(r.type, TensorType)]
    if fn is not None:
        out = _shaped(results[0]) if len(results) == 1 else [_shaped(r) for r in results]
        try:
            return float(fn(*[_shaped(a) for a in op.args], out_val=out, **{k: _shaped(v) for k, v in op.kwargs}))
        except (TypeError, ValueError, IndexError):
            return 0.0
    own = OWN_FLOPS.get(op.target)
    if own is not None:
        return own(op)
    name = str(packet or "")
    if "attention" in name:
        q, k = (v.type for v in op.operands[:2])
        assert isinstance(q, TensorType) and isinstance(k, TensorType)
        dims = [size_hint(x) for x in q.shape]
        b, h, s, d = dims[-4:] if q.rank >= 4 else (1, 1, dims[-2], dims[-1])
        fwd = 4.0 * b * h * s * size_hint(k.shape[-2]) * d
        return fwd * 2.5 if "backward" in name else fwd
    return 0.0


def _affine_scan_flops(op: Op, backward: bool) -> float:
    """A linear recurrence: per step one k x k by k x v product (diagonal: k x v products); three
    times that backward."""
    states = op.operands[1].type if backward else op.results[0].type
    assert isinstance(states, TensorType)
    diagonal = True in op.args or dict(op.kwargs).get("diagonal") is True
    fwd = 2.0 * size_hint(states.numel()) * (1 if diagonal else size_hint(states.shape[-2]))
    return 3 * fwd if backward else fwd


def _ring_step_flops(op: Op, backward: bool) -> float:
    """One ring step of every rank (``ir.dialects.ring.step_area``): ``4 b h d L^2`` over the blocks' share of
    the score matrix; 2.5 times that backward."""
    q = op.operands[1 if backward else 0].type
    assert isinstance(q, TensorType)
    b, h, s, d = (size_hint(x) for x in q.shape)
    at = 7 if backward else 4
    size, step, causal, zigzag = op.args[at : at + 4]
    qstep = op.args[at + 5] if len(op.args) > at + 5 else 0  # NOTE: after the scale
    area = step_area(int(size), int(step), bool(causal), bool(zigzag), int(qstep))  # type: ignore[arg-type]
    fwd = 4.0 * b * h * s * s * d * area
    return 2.5 * fwd if backward else fwd


def _experts_flops(op: Op, backward: bool) -> float:
    """Routed experts: per token and choice, a gated MLP (three GEMMs of H x I); twice that backward."""
    at = 1 if backward else 0
    hidden, idx, down = (op.operands[at].type, op.operands[at + 1].type, op.operands[at + 4].type)
    assert isinstance(hidden, TensorType) and isinstance(idx, TensorType) and isinstance(down, TensorType)
    tokens, k = int(idx.shape[0]), int(idx.shape[1])
    h, inter = int(down.shape[1]), int(down.shape[2])
    fwd = 6.0 * tokens * k * h * inter
    return 2 * fwd if backward else fwd


OWN_FLOPS: dict[Target, Callable[[Op], float]] = {
    EXPERTS: lambda op: _experts_flops(op, backward=False),
    EXPERTS_BACKWARD: lambda op: _experts_flops(op, backward=True),
    SCAN: lambda op: _affine_scan_flops(op, backward=False),
    SCAN_BACKWARD: lambda op: _affine_scan_flops(op, backward=True),
    RING_STEP: lambda op: _ring_step_flops(op, backward=False),
    RING_STEP_BACKWARD: lambda op: _ring_step_flops(op, backward=True),
}
"""FLOPs of our own ops (``ir.dialects``), which torch's formulas do not know."""

MEMORY_BOUND: frozenset[Target] = frozenset({LSE_MERGE, CONSTANT, CONV, CONV_BACKWARD})
"""Our ops priced by the bytes they read and write alone (``op_flops`` 0): a merge of two partial
attention results, a literal, and the depthwise causal convolution (a few FLOPs per element)."""
