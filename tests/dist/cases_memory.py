"""Tasks that measure a compiled model's peak tensor memory on each rank and set it beside the
liveness estimate of ``passes.cost.liveness`` for the same compiled graph."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from meshfold.api import parallelize
from meshfold.ir.asynchrony import starts
from meshfold.ir.ops import RELOAD
from meshfold.passes.cost.liveness import rank_memory
from meshfold.tools.measure import allocator_accounting, settled_peak_new_bytes, storage_bytes
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build
from meshfold.tools.zoo.models import LlamaTiny
from tests.dist.captures import shared_capture
from tests.dist.cases import assert_step_matches, reference_experts


@allocator_accounting()
def step_memory(
    shape: tuple[int, ...],
    names: tuple[str, ...],
    plan: str,
    hidden: int = 64,
    batch: int = 8,
    seq: int = 64,
    memory: int | str | None = None,
    model: str | None = None,
    moe: dict[str, Any] | None = None,
    cluster: str | None = None,
) -> dict[str, Any]:
    """Compile a model, take one AdamW step (so the optimizer state exists; its loss and every
    gradient checked against the single-device model's, so what is measured is a right program),
    then measure the next steps' forward + backward: resident bytes (parameters, buffers, optimizer
    state) plus the allocator's peak on top of them, the lower of two steps
    (``settled_peak_new_bytes``: gloo's worker thread can hold a finished collective's tensors past
    its wait). Returns measured and estimated figures on this rank.

    ``model``: None for a Llama-style model of width ``hidden``; else a zoo language model's name or
    ``"hf:<arch>"`` for one of ``tests.dist.hf_models``; each on ``batch`` x ``seq`` tokens. ``moe``:
    the routed experts' mapping, as ``parallelize`` takes it; ``cluster``: the hardware the program is
    planned and scheduled for (it runs on these gloo ranks all the same, and the estimate is gloo's)."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    mesh = device_mesh(tuple(shape), tuple(names))
    net, (ids, labels) = _language_model(model, hidden, batch, seq)
    ref = copy.deepcopy(net)
    with shared_capture(f"language-model:{model}"):
        pm = parallelize(net, mesh, (ids, labels), plan=plan, memory=memory, moe=moe, cluster=cluster)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=False)
    loss = pm(ids, labels)
    loss.backward()
    with reference_experts(ref, moe):
        ref_loss = ref(ids, labels)
    ref_loss.backward()
    assert_step_matches(pm, loss, ref, ref_loss, pm.graph().stacks)
    del ref, ref_loss, loss
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = [p for p in pm.parameters()]
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    resident = storage_bytes(params + list(pm.buffers()) + states)
    kept: list[torch.Tensor] = []

    def step() -> None:
        loss = pm(ids, labels)
        loss.backward()
        kept.append(loss)

    def fresh() -> None:
        opt.zero_grad(set_to_none=True)  # NOTE: each step makes its gradients anew, as the first did
        kept.clear()

    measured = resident + settled_peak_new_bytes(step, before=fresh)
    est = rank_memory(pm.graph())
    return {
        "measured": measured,
        "estimated": est.peak,
        "resident_measured": resident,
        "resident_estimated": est.resident,
        "peak_at": est.peak_at,
        "reloads_started": sum(1 for s in starts(pm.graph()).values() if s.target == RELOAD),
    }


def _language_model(
    model: str | None, hidden: int, batch: int, seq: int
) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model ``step_memory`` measures and its (ids, labels) of ``batch`` x ``seq`` tokens."""
    if model is None:
        ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))
        return LlamaTiny(vocab=256, hidden=hidden, intermediate=2 * hidden), (ids, ids)
    if model.startswith("hf:"):
        from tests.dist.hf_models import build_hf

        return build_hf(model.removeprefix("hf:"), 2, batch, seq)
    from tests.dist.cases import token_inputs

    return build(model)[0], token_inputs((batch, seq))
