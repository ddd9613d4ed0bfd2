"""Tasks for pipeline parallelism: a model trained by ``pm.step`` on a mesh with a ``pp`` axis, compared
with the single-device model on the whole batch (loss, every gradient this rank holds, the parameters
after AdamW steps)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from meshfold.api import parallelize
from meshfold.passes import PassError
from meshfold.pp.pipelined import IGNORE_INDEX
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build
from meshfold.tools.zoo.models import DecoderLayer, _small_init
from tests.dist.cases import ATOL, EPS, LR, PARAM_ATOL, RTOL


def deep_llama(layers: int, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The zoo's llama-tiny with ``layers`` decoder layers, and a batch of 8 sequences of 16 tokens."""
    torch.manual_seed(seed)
    model, _ = build("llama-tiny")
    model.layers = nn.ModuleList(DecoderLayer(64, 128, 0, True) for _ in range(layers))
    model.apply(_small_init)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(seed))
    return model, (ids, ids.clone())


def hf_llama_tied(layers: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """transformers' LlamaForCausalLM with ``layers`` layers and its output layer tied to the token
    embedding (random weights), and a batch of 8 sequences of 16 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshfold.tools.zoo.hf_zoo import _HF_COMMON, _hf_causal_lm

    common = _HF_COMMON | {"num_hidden_layers": layers, "tie_word_embeddings": True}
    model, _ = _hf_causal_lm(LlamaConfig, LlamaForCausalLM, common, intermediate_size=128)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone())


def hf_mixtral(layers: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """transformers' MixtralForCausalLM (4 experts, top 2) with ``layers`` layers and no auxiliary
    loss (``output_router_logits=False``), and a batch of 8 sequences of 16 tokens."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from meshfold.tools.zoo.hf_zoo import _HF_COMMON, _hf_causal_lm

    common = _HF_COMMON | {"num_hidden_layers": layers}
    model, _ = _hf_causal_lm(
        MixtralConfig,
        MixtralForCausalLM,
        common,
        experts_implementation="batched_mm",
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=False,
    )
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone())


MODELS = {"llama": deep_llama, "hf-llama-tied": hf_llama_tied, "hf-mixtral": hf_mixtral}


def pipelined_equivalence(
    shape: tuple[int, ...],
    names: tuple[str, ...],
    plan: str,
    pp: dict[str, Any],
    layers: int = 4,
    steps: int = 2,
    model: str = "llama",
    moe: dict[str, Any] | None = None,
    memory: str | None = None,
    ignored: bool = False,
    backend: str = "eager",
) -> dict[str, Any]:
    """Train ``steps`` AdamW steps pipelined and on one device side by side; raise on any difference.
    ``ignored``: one label of every sequence is the ignored index, so every microbatch counts as many."""
    warnings.filterwarnings("ignore")
    # NOTE: no axis names: the world alone, whose mesh ``plan="auto"`` chooses among pipelines
    mesh: Any = device_mesh(tuple(shape), tuple(names)) if names else math.prod(shape)
    net, inputs = MODELS[model](layers)
    if ignored:
        inputs[1][:, 5] = IGNORE_INDEX
    ref, _ = MODELS[model](layers)
    pm = parallelize(net, mesh, inputs, plan=plan, pp=pp, moe=moe, memory=memory, backend=backend)
    held = dict(pm.named_parameters())
    assert held, "this rank holds no parameters"
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    assert set(held) <= set(ref_params), sorted(set(held) - set(ref_params))
    losses = []
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pm.step(*inputs)
        ref_loss = ref(*inputs)
        ref_loss.backward()
        torch.testing.assert_close(
            loss, ref_loss.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, s=step: f"step {s} loss: {m}"
        )
        for name, p in held.items():
            assert p.grad is not None, f"{name} has no gradient"
            torch.testing.assert_close(
                p.grad.full_tensor(),
                ref_params[name].grad,
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m, n=name, s=step: f"step {s} grad {n}: {m}",
            )
        opt.step()
        ref_opt.step()
        losses.append(float(loss))
    for name, p in held.items():
        torch.testing.assert_close(
            p.detach().full_tensor(),
            ref_params[name].detach(),
            rtol=0,
            atol=PARAM_ATOL,
            msg=lambda m, n=name: f"param {n}: {m}",
        )
    targets = sorted({str(op.target) for s in pm.stages() for op in pm.stage_graph(s).ops})
    # NOTE: a pipeline's stages send and receive unequal numbers of messages over its own groups; with
    # them gone the pool's ranks agree again on the state they share
    pm.close()
    return {
        "losses": losses,
        "stages": pm.stages(),
        "held": sorted(held),
        "report": pm.plan_report(),
        "mesh": (tuple(pm.mesh.mesh_dim_names or ()), tuple(pm.mesh.mesh.shape)),
        "ops": targets,
        "schedule": (pm.spec.schedule, pm.spec.virtual),
        # NOTE: what ran each stage's programs: fx modules (eager) or Inductor's compiles of them
        "runs": sorted({type(m).__name__ for st in pm._modules_.values() for m in (st.low.forward, st.low.backward)}),
    }


def uneven_ignored_labels_refused() -> list[str]:
    """A batch whose ignored labels fall unevenly on the microbatches is refused on every rank, before
    the schedule runs; the module still steps on a batch without them."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("pp", "dp"))
    net, (ids, labels) = deep_llama(4)
    pm = parallelize(net, mesh, (ids, labels), plan="pp+fsdp", pp={"schedule": "1f1b", "microbatches": 4})
    uneven = labels.clone()
    uneven[0, 3:9] = IGNORE_INDEX
    try:
        pm.step(ids, uneven)
    except PassError as e:
        message = str(e)
    else:
        raise AssertionError("a batch with unevenly ignored labels was not refused")
    loss = pm.step(ids, labels)
    pm.close()
    return [message, f"{float(loss):.6f}"]


def pipelined_verify(
    shape: tuple[int, ...], names: tuple[str, ...], plan: str, pp: dict[str, Any], corrupt: str = ""
) -> str:
    """``verify=True`` on a pipeline: the first step checks every value of every stage (microbatch 0)
    against the whole program on whole tensors; with one rank's shard of ``corrupt`` perturbed, every
    rank raises the same error naming the first value that differs. Returns the error text ("" when
    the step passed); a second step is not verified and must run."""
    from meshfold.runtime.crosscheck import VerificationError

    warnings.filterwarnings("ignore")
    mesh = device_mesh(tuple(shape), tuple(names))
    net, inputs = deep_llama(4)
    pm = parallelize(net, mesh, inputs, plan=plan, pp=pp, verify=True)
    held = dict(pm.named_parameters())
    # NOTE: the last rank holding it perturbs its shard (the other ranks of its stage do not)
    if corrupt in held and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        with torch.no_grad():
            held[corrupt].to_local().add_(1.0)
    try:
        pm.step(*inputs)
        message = ""
    except VerificationError as e:
        message = str(e)
    pm.step(*inputs)  # NOTE: the second step runs the plain programs, unchecked
    pm.close()
    return message
