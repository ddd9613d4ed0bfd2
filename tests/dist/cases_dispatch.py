"""Tasks for the MoE dispatchers on ranks: equivalence with single device, plus how the compiled
experts ops are laid out (tokens split means the all-to-all exchange, replicated the all-gather)."""

from __future__ import annotations

from typing import Any

import torch

from compiler.moe import MoeSpec, experts_as_ops
from compiler.zoo import build
from ir.moe import EXPERTS, EXPERTS_BACKWARD
from tests.dist.cases import equivalence


def dispatched(
    model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, moe: dict[str, Any]
) -> dict[str, Any]:
    """``equivalence`` with ``moe=``; adds, per experts op, the layouts of its tokens and weights."""
    out = equivalence(model, shape, names, plan, moe=moe, keep_module=True)
    if moe.get("capacity_factor") is not None:
        # NOTE: the same fresh model on one device through the same experts op, without and with the
        # drops: any difference is the drops'
        net, inputs = build(model)
        with torch.no_grad():
            with experts_as_ops(net):
                out["dropless_loss"] = float(net(*inputs))
            with experts_as_ops(net, MoeSpec.of(moe)):
                out["dropping_loss"] = float(net(*inputs))
    pm = out.pop("module")
    at = {EXPERTS: (0, 3), EXPERTS_BACKWARD: (1, 4)}
    out["experts_ops"] = [
        (str(op.operands[at[op.target][0]].layout), str(op.operands[at[op.target][1]].layout))
        for op in pm.graph().ops
        if op.target in at
    ]
    return out


def padded_splits(
    model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, moe: dict[str, Any]
) -> dict[str, Any]:
    """``dispatched``, recording the split sizes of every all-to-all the step makes."""
    import torch.distributed as dist

    calls: list[tuple[Any, Any]] = []
    real = dist.all_to_all_single

    def recording(
        output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None, **kw: Any
    ) -> Any:
        calls.append((output_split_sizes, input_split_sizes))
        return real(output, input, output_split_sizes, input_split_sizes, **kw)

    dist.all_to_all_single = recording  # type: ignore[assignment]
    try:
        out = dispatched(model, shape, names, plan, moe)
    finally:
        dist.all_to_all_single = real  # type: ignore[assignment]
    out["splits"] = calls
    return out
