"""Tasks for expert parallelism on ranks: the compiled step equals single device, and the experts
really are split (each rank holds and computes only its own)."""

from __future__ import annotations

from typing import Any

from ir.moe import EXPERTS, EXPERTS_BACKWARD
from tests.dist.cases import equivalence


def folded(
    model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, moe: dict[str, Any]
) -> dict[str, Any]:
    """``equivalence`` with ``moe=``, plus what each expert op computes with: the placements of its
    expert weights on every mesh axis, and the local bytes this rank stores for expert weights."""
    from torch.distributed.tensor import DTensor

    out = equivalence(model, shape, names, plan, moe=moe, keep_module=True)
    pm = out.pop("module")
    ops = [op for op in pm.graph().ops if op.target in (EXPERTS, EXPERTS_BACKWARD)]
    w_at = {EXPERTS: 3, EXPERTS_BACKWARD: 4}
    out["expert_ops"] = [str(op.operands[w_at[op.target]].layout) for op in ops]
    local = 0
    for name, p in pm.named_parameters():
        if name.endswith(("gate_up_proj", "down_proj")) and isinstance(p, DTensor):
            local += p.to_local().numel()
    out["expert_numel_local"] = local
    return out
