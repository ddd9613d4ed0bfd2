"""Tasks for expert parallelism on ranks: the compiled step equals single device, and the experts
really are split (each rank holds and computes only its own)."""

from __future__ import annotations

from typing import Any

from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD
from tests.dist.cases import equivalence


def folded(
    model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, moe: dict[str, Any]
) -> dict[str, Any]:
    """``equivalence`` with ``moe=``, plus what each expert op computes with: the placements of its
    expert weights on every mesh axis, and the elements of expert weights this rank stores
    (``expert_numel_local``) out of the model's whole (``expert_numel_total``)."""
    from torch.distributed.tensor import DTensor

    from meshfold.tools.zoo import build
    from meshfold.tracing.moe_layers import find_experts

    sites, _ = find_experts(build(model)[0])
    # NOTE: experts folded from an nn.ModuleList are the graph's stacked parameters.
    expert_fqns = {fqn for site in sites for fqn in (site.gate_up, site.down)}
    out = equivalence(model, shape, names, plan, moe=moe, keep_module=True)
    pm = out.pop("module")
    expert_fqns |= {s.name for s in pm.graph().stacks}
    ops = [op for op in pm.graph().ops if op.target in (EXPERTS, EXPERTS_BACKWARD)]
    w_at = {EXPERTS: 3, EXPERTS_BACKWARD: 4}
    out["expert_ops"] = [str(op.operands[w_at[op.target]].layout) for op in ops]
    local = total = 0
    for name, p in pm.named_parameters():
        if name in expert_fqns:
            assert isinstance(p, DTensor), f"{name} is not a DTensor"
            local += p.to_local().numel()
            total += p.numel()
    n_sites = len(sites) + len(pm.graph().stacks) // 2
    assert total and len(expert_fqns) == 2 * n_sites, f"expert weights missing: {sorted(expert_fqns)}"
    out["expert_numel_local"], out["expert_numel_total"] = local, total
    # NOTE: stacked [E, 2, I, H] gate/up weights (ModuleList experts) are split by ETP as well
    out["etp_splits_gate_up"] = bool(pm.graph().stacks) and not sites
    return out
