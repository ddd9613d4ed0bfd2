"""Tasks for tests/dist/test_state_dict.py: ``pm.model_state_dict()`` loads back into the single-device model."""

from __future__ import annotations

import warnings

import torch

from meshfold.api import parallelize
from meshfold.tools.zoo import build
from tests.dist.cases import EPS, LR, PARAM_ATOL, RTOL
from tests.dist.pool import device_mesh


def state_dict_round_trip(
    model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, steps: int = 1
) -> dict[str, float]:
    """Train ``steps`` AdamW steps compiled and single-device side by side, load ``pm.model_state_dict()``
    into a fresh single-device model with ``strict=True``, and check every entry of its state dict (and
    its loss) against the trained single-device model. Returns how far training moved the weights and
    the largest difference after loading."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh(tuple(shape), tuple(names))
    net, inputs = build(model)
    ref, _ = build(model)
    pm = parallelize(net, mesh, inputs, plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    for _ in range(steps):
        for o, m in ((opt, pm), (ref_opt, ref)):
            o.zero_grad()
            m(*inputs).backward()
            o.step()
    fresh, _ = build(model)
    untrained = {k: v.clone() for k, v in fresh.state_dict().items()}
    fresh.load_state_dict(pm.model_state_dict(), strict=True)
    want = ref.state_dict()
    got = fresh.state_dict()
    assert list(got) == list(want), sorted(set(got) ^ set(want))
    worst, moved = 0.0, 0.0
    for key, t in got.items():
        torch.testing.assert_close(t, want[key], rtol=0, atol=PARAM_ATOL, msg=lambda m, k=key: f"{k}: {m}")
        worst = max(worst, float((t - want[key]).abs().max()))
        moved = max(moved, float((t - untrained[key]).abs().max()))
    # NOTE: non-persistent buffers are not in the state dict; loading must leave the fresh model's own.
    for name, buf in fresh.named_buffers():
        torch.testing.assert_close(buf, dict(ref.named_buffers())[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(fresh(*inputs), ref(*inputs), rtol=RTOL, atol=1e-5)
    return {"worst": worst, "moved": moved}
