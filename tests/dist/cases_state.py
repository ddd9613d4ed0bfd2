"""Tasks for tests/dist/test_state_dict.py: ``pm.model_state_dict()`` loads back into the single-device model."""

from __future__ import annotations

import shutil
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from meshfold.api import parallelize
from meshfold.tools.zoo import build
from tests.dist.cases import EPS, LR, PARAM_ATOL, RTOL
from tests.dist.pool import device_mesh

FULL = StateDictOptions(full_state_dict=True)


def _side_by_side(
    model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str
) -> tuple[Any, torch.nn.Module, tuple[Any, ...], torch.optim.Optimizer, torch.optim.Optimizer]:
    """Zoo ``model`` compiled for the mesh beside its single-device copy, each with its own AdamW."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh(tuple(shape), tuple(names))
    net, inputs = build(model)
    ref, _ = build(model)
    pm = parallelize(net, mesh, inputs, plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    return pm, ref, inputs, opt, ref_opt


def state_dict_round_trip(
    model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, steps: int = 1
) -> dict[str, float]:
    """Train ``steps`` AdamW steps compiled and single-device side by side, load ``pm.model_state_dict()``
    into a fresh single-device model with ``strict=True``, and check every entry of its state dict (and
    its loss) against the trained single-device model. Returns how far training moved the weights and
    the largest difference after loading."""
    pm, ref, inputs, opt, ref_opt = _side_by_side(model, shape, names, plan)
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


def _train(pairs: list[tuple[torch.nn.Module, torch.optim.Optimizer]], inputs: tuple[Any, ...], steps: int) -> None:
    for _ in range(steps):
        for m, o in pairs:
            o.zero_grad()
            m(*inputs).backward()
            o.step()


def _same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest difference; raises unless ``got`` has exactly ``want``'s keys and values within PARAM_ATOL."""
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    worst = 0.0
    for key, t in got.items():
        t = t.full_tensor() if isinstance(t, DTensor) else t
        torch.testing.assert_close(t, want[key], rtol=0, atol=PARAM_ATOL, msg=lambda m, k=key: f"{k}: {m}")
        worst = max(worst, float((t - want[key]).abs().max()))
    return worst


def dcp_round_trip(model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str) -> dict[str, Any]:
    """``pm.state_dict()`` and ``get_model_state_dict(pm, full_state_dict=True)`` have exactly the model's
    keys; a DCP checkpoint of the single-device model loads into ``pm`` (``set_model_state_dict``) and
    training continues equal to the single-device model; one written from ``pm`` loads into a fresh
    single-device model with the trained weights."""
    pm, ref, inputs, opt, ref_opt = _side_by_side(model, shape, names, plan)
    # NOTE: the model's own state dict, non-persistent buffers (rotary tables) left out, tied weights in.
    keys = {"state_dict": sorted(pm.state_dict()), "full": sorted(get_model_state_dict(pm, options=FULL))}
    for k in keys.values():
        assert k == sorted(ref.state_dict()), sorted(set(k) ^ set(ref.state_dict()))
    _train([(ref, ref_opt)], inputs, 1)
    paths: list[Any] = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(paths)
    try:
        dcp.save(ref.state_dict(), checkpoint_id=f"{paths[0]}/from_ref")
        sd = get_model_state_dict(pm)
        dcp.load(sd, checkpoint_id=f"{paths[0]}/from_ref")
        set_model_state_dict(pm, sd)
        # NOTE: the checkpoint holds weights only, so both sides go on with a fresh optimizer.
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
        loaded = _same_weights(get_model_state_dict(pm, options=FULL), ref.state_dict())
        _train([(pm, opt), (ref, ref_opt)], inputs, 2)
        trained = _same_weights(get_model_state_dict(pm, options=FULL), ref.state_dict())
        dcp.save(get_model_state_dict(pm), checkpoint_id=f"{paths[0]}/from_pm")
        fresh, _ = build(model)
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=f"{paths[0]}/from_pm")
        fresh.load_state_dict(sd, strict=True)
        back = _same_weights(fresh.state_dict(), ref.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(fresh(*inputs), ref(*inputs), rtol=RTOL, atol=1e-5)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(paths[0], ignore_errors=True)
    return {"loaded": loaded, "trained": trained, "back": back}
