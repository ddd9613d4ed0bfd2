"""Tasks for tests/dist/test_state_dict.py: ``pm.model_state_dict()`` loads back into the single-device model."""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from meshfold.api import parallelize
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build
from tests.dist.cases import ATOL, EPS, LR, PARAM_ATOL, RTOL
from tests.dist.hf_models import SMALL

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


def _llama_steps(n: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` llama-tiny batches of ``batch`` sequences of the zoo's length."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 256, (batch, 16), generator=gen)
        out.append((ids, ids.clone()))
    return out


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[Any]) -> list[float]:
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def dcp_across_meshes(
    where: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, batch: int
) -> dict[str, Any]:
    """Train llama-tiny 2 AdamW steps under fsdp+tp on (dp=2, tp=2), save model and optimizer with DCP
    to ``where``, load both into llama-tiny compiled for ``shape``/``names`` with ``plan`` and train 2
    more on batches of ``batch`` sequences: the 4 losses and the weights after equal one uninterrupted
    single-device run (a fresh optimizer would move the weights by ~lr). Returns the losses and layouts."""
    warnings.filterwarnings("ignore")
    batches = _llama_steps(4, batch)
    ref, _ = build("llama-tiny")
    ref_losses = _steps(ref, torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS), batches)
    net, _ = build("llama-tiny")
    first = parallelize(net, device_mesh((2, 2), ("dp", "tp")), batches[0], plan="fsdp+tp")
    opt = torch.optim.AdamW(first.parameters(), lr=LR, eps=EPS)
    losses = _steps(first, opt, batches[:2])
    model_sd, optim_sd = get_state_dict(first, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where)
    net, _ = build("llama-tiny")
    second = parallelize(net, device_mesh(tuple(shape), tuple(names)), batches[0], plan=plan)
    opt = torch.optim.AdamW(second.parameters(), lr=LR, eps=EPS)
    model_sd, optim_sd = get_state_dict(second, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=where)
    set_state_dict(second, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses += _steps(second, opt, batches[2:])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=1e-5)
    _same_weights(get_model_state_dict(second, options=FULL), ref.state_dict())
    return {"losses": losses, "layouts": sorted({str(i.value.layout) for i in second.graph().inputs})}


def _hf_llama_config() -> Any:
    """A tiny Llama config whose LM head is tied to the embedding."""
    from transformers import LlamaConfig

    return LlamaConfig(**SMALL, tie_word_embeddings=True, attn_implementation="sdpa")


def _hf_llama(config: Any) -> torch.nn.Module:
    """LlamaForCausalLM on ``config`` with seeded random weights, returning ``(loss, logits)``."""
    from transformers import LlamaForCausalLM

    class LossAndLogits(LlamaForCausalLM):  # type: ignore[misc]
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = super().forward(input_ids=input_ids, labels=labels, use_cache=False)
            return out.loss, out.logits

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LossAndLogits(config)


def hf_save_pretrained(shape: tuple[int, ...], names: tuple[str, ...], plan: str, steps: int = 2) -> dict[str, Any]:
    """A tiny HF Llama (tied LM head) trained ``steps`` AdamW steps compiled; ``pm.model_state_dict()``
    loads strictly into a fresh model from the same config, which ``save_pretrained`` writes as
    safetensors and ``from_pretrained`` reads back: the reloaded model's parameters equal the state dict
    and its loss and logits equal the compiled module's (both equal the single-device model trained
    alongside). Returns how far training moved the weights and the largest logit difference."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    warnings.filterwarnings("ignore")
    config = _hf_llama_config()
    net, ref = _hf_llama(config), _hf_llama(config)
    batches = _llama_steps(steps + 1, batch=2)
    pm = parallelize(net, device_mesh(tuple(shape), tuple(names)), batches[0], plan=plan)
    for m in (pm, ref):
        _steps(_LossOnly(m), torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS), batches[:steps])
    sd = pm.model_state_dict()  # NOTE: collective: every rank gathers
    loss, logits = (t.detach() for t in pm(*batches[steps]))
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        fresh = LlamaForCausalLM(config)
        fresh.load_state_dict(sd, strict=True)
        with tempfile.TemporaryDirectory() as tmp:
            fresh.save_pretrained(tmp)
            with safe_open(f"{tmp}/model.safetensors", "pt") as f:
                saved = set(f.keys())
            reloaded = LlamaForCausalLM.from_pretrained(tmp)
        # NOTE: the tied LM head is written once and tied again on load
        assert saved < set(sd) and len(saved) == len(sd) - 1, sorted(set(sd) ^ saved)
        assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
        got = reloaded.state_dict()
        assert list(got) == list(sd), sorted(set(got) ^ set(sd))
        for key, t in got.items():
            torch.testing.assert_close(t, sd[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
        _same_weights(sd, ref.state_dict())
        with torch.no_grad():
            back = reloaded(input_ids=batches[steps][0], labels=batches[steps][1], use_cache=False)
            ref_loss, ref_logits = ref(*batches[steps])
        for a, b in ((back.loss, loss), (back.logits, logits), (ref_loss, loss), (ref_logits, logits)):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-5)
        untrained = _hf_llama(config).state_dict()
        out["moved"] = max(float((sd[k] - untrained[k]).abs().max()) for k in sd)
        out["worst"] = float((back.logits - logits).abs().max())
    dist.barrier()
    return out


class _LossOnly(torch.nn.Module):
    """Calls a ``(loss, logits)`` model and returns the loss, for ``_steps``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *batch: Any) -> torch.Tensor:
        loss: torch.Tensor = self.model(*batch)[0]
        return loss


def async_checkpoint_resumes(where: str) -> dict[str, Any]:
    """llama-tiny trained 2 AdamW steps under fsdp on dp=2 and checkpointed asynchronously (with a data
    position), a third step taken while the write is in flight; a folder of step 3 left without its
    marker (a write cut short); then the module compiled under tp on tp=2 resumes from the newest
    complete checkpoint and trains steps 2-3: its gradients at the loaded weights and the losses equal
    one uninterrupted single-device run's, and the position and the programs' generator come back as
    they were at step 2."""
    warnings.filterwarnings("ignore")
    batches = _llama_steps(4, batch=2)
    ref, _ = build("llama-tiny")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    ref_losses = _steps(ref, ref_opt, batches[:2])
    ref_opt.zero_grad()
    ref(*batches[2]).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}  # NOTE: at the checkpoint's weights
    ref_losses += _steps(ref, ref_opt, batches[2:])
    net, _ = build("llama-tiny")
    first = parallelize(net, device_mesh((2,), ("dp",)), batches[0], plan="fsdp")
    opt = torch.optim.AdamW(first.parameters(), lr=LR, eps=EPS)
    losses = _steps(first, opt, batches[:2])
    first.manual_seed(7)
    rng_at_save = first._mf_rng.get_state().clone()
    pending = first.checkpoint(where, 2, optimizer=opt, state={"position": torch.tensor([2, 48])})
    _steps(first, opt, batches[2:3])  # NOTE: weights change while the write is in flight
    first.manual_seed(8)
    first.wait_checkpoint()
    assert pending.done() and pending.exception() is None
    if dist.get_rank() == 0:
        shutil.copytree(f"{where}/step-00000002", f"{where}/step-00000003")
        (Path(where) / "step-00000003" / "COMPLETE.json").unlink()
    dist.barrier()
    net, _ = build("llama-tiny")
    second = parallelize(net, device_mesh((2,), ("tp",)), batches[0], plan="tp")
    opt = torch.optim.AdamW(second.parameters(), lr=LR, eps=EPS)
    position = torch.zeros(2, dtype=torch.int64)
    step = second.resume(where, optimizer=opt, state={"position": position})
    assert step == 2, step
    assert position.tolist() == [2, 48]
    assert torch.equal(second._mf_rng.get_state(), rng_at_save)
    opt.zero_grad()
    second(*batches[2]).backward()
    for name, param in second.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m, k=name: f"{k}: {m}")
    losses += _steps(second, opt, batches[2:])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=1e-5)
    _same_weights(get_model_state_dict(second, options=FULL), ref.state_dict())
    return {"losses": losses, "files": sorted(p.name for p in (Path(where) / "step-00000002").iterdir())}


def train_resumes_under_a_fixed_plan(where: str) -> dict[str, Any]:
    """``meshfold.train`` with a fixed plan: 4 steps of llama-tiny under fsdp+tp with tp=2 (dp takes the
    other 2 ranks), a checkpoint every 2; then the same run asked for 6 steps with tp=4 resumes at step
    4 and trains 2 more. Every loss equals the single-device run's. A tp the world does not divide is
    refused on every rank before anything is compiled."""
    from meshfold.elastic import train
    from meshfold.passes import PassError
    from meshfold.tools.local_agents import batch_of, reference_losses

    warnings.filterwarnings("ignore")
    ref = reference_losses("llama-tiny", 6, LR)

    def run(steps: int, tp: int) -> Any:
        return train(
            lambda: build("llama-tiny")[0],
            batch_of,
            steps,
            where,
            every=2,
            optimizer=lambda p: torch.optim.AdamW(p, lr=LR),
            plan="fsdp+tp",
            mesh={"tp": tp},
        )

    first = run(4, 2)
    second = run(6, 4)
    refused = ""
    try:
        run(8, 3)
    except PassError as e:
        refused = str(e)
    losses = first.losses + second.losses
    assert [s for s, _ in losses] == list(range(6)), losses
    torch.testing.assert_close(torch.tensor([v for _, v in losses]), torch.tensor(ref), rtol=RTOL, atol=1e-5)
    return {"meshes": [first.mesh, second.mesh], "starts": [first.start, second.start], "refused": refused}
