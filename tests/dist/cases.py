"""Tasks that run on every rank of a pool: compile a model with a plan and compare it, step by step,
with the single-device model (loss, every gradient, and the parameters after AdamW steps)."""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch

from meshfold.api import parallelize
from meshfold.ir import ParamStack
from meshfold.passes.memory.policies import Saved
from meshfold.rewrites.moe_lists import as_stacked
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build
from meshfold.tracing.moe_layers import MoeSpec, experts_as_ops
from tests.dist.captures import shared_capture

RTOL, ATOL = 1e-5, 1e-6
LR = 1e-3
# NOTE: Adam's update is about lr * g/|g|, so on gradients near zero it turns 1e-9 of float noise
# into a visible step; parameters must agree to 5% of one step, which any wrong update exceeds.
PARAM_ATOL = 0.05 * LR
# NOTE: Adam divides by sqrt(v) + eps, so with torch's eps=1e-8 a gradient of ~1e-9 moves its
# parameter by a sizeable fraction of lr in a direction set by rounding noise; summation order
# (any sharding) then changes the next step's gradients by far more than fp32 rounding. eps=1e-6
# keeps updates of near-zero gradients proportional to the gradient, on both sides alike.
EPS = 1e-6


def equivalence(
    model: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    plan: Any,
    steps: int = 2,
    cluster: str | None = None,
    memory: int | str | None = None,
    moe: dict[str, Any] | None = None,
    keep_module: bool = False,
    pipeline: str | None = None,
    tokens: tuple[int, int] | None = None,
    cp: str | None = None,
    double: bool = False,
    inputs: tuple[torch.Tensor, ...] | None = None,
    ref_inputs: tuple[torch.Tensor, ...] | None = None,
    backend: str = "eager",
    windows: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` AdamW steps compiled (under ``pipeline``, default the default pipeline) and
    single-device side by side; raise on any difference. Also returns the parameters' layouts
    (``plan="auto"`` chooses them). ``tokens``: (batch, sequence) of fresh token inputs in place of
    the zoo's, for the zoo's language models; ``inputs``: the compiled program's in place of the
    zoo's, and ``ref_inputs`` the single-device model's where they differ (a packed row in another
    order). ``windows`` (Inductor): also returns, per collective, the matrix products in flight beside
    it in the eager programs and in the code Inductor generated (``cases_backends.first_step_windows``)."""
    warnings.filterwarnings("ignore")
    # NOTE: no axis names: the world alone, whose mesh ``plan="auto"`` chooses
    mesh: Any = device_mesh(tuple(shape), tuple(names)) if names else math.prod(shape)
    net, zoo_inputs = build(model)
    ref, _ = build(model)
    inputs = zoo_inputs if inputs is None else inputs
    if double:  # NOTE: float64 leaves only the compiled program's own differences, not rounding
        net, ref = net.double(), ref.double()
    if tokens is not None:
        inputs = token_inputs(tokens)
    ref_inputs = inputs if ref_inputs is None else ref_inputs
    extra: dict[str, Any] = {} if pipeline is None else {"pipeline": pipeline}
    if cp is not None:
        extra["cp"] = {"method": cp}
    with shared_capture(f"zoo:{model}"):
        pm = parallelize(
            net, mesh, inputs, plan=plan, cluster=cluster, memory=memory, moe=moe, backend=backend, **extra
        )
    stacks = pm.graph().stacks
    names_pm = [n for n, _ in pm.named_parameters()]
    # NOTE: stacked experts sit in the module tree where their list is, so only the set is compared for them.
    stacked = {s.name for s in stacks}
    want_names = list(_as_compiled(ref, stacks, "param"))
    assert sorted(names_pm) == sorted(want_names), "parameter FQNs differ from the model's"
    assert [n for n in names_pm if n not in stacked] == [n for n in want_names if n not in stacked]
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    worst = 0.0
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        if windows and step == 0:
            from tests.dist.cases_backends import first_step_windows

            loss, overlap = first_step_windows(pm, lambda: _trained(pm, inputs))
        else:
            loss = _trained(pm, inputs)
        with reference_experts(ref, moe):
            ref_loss = ref(*ref_inputs)
        ref_loss.backward()
        worst = max(worst, assert_step_matches(pm, loss, ref, ref_loss, stacks, step))
        opt.step()
        ref_opt.step()
    ref_params = _as_compiled(ref, stacks, "param")
    for name, p in pm.named_parameters():
        torch.testing.assert_close(
            p.detach().full_tensor(),
            ref_params[name],
            rtol=0,
            atol=PARAM_ATOL,
            msg=lambda m, n=name: f"param {n} after {steps} steps: {m}",
        )
    if stacks:
        # NOTE: the model's own names and per-expert weights come back out of the stacks
        own = pm.model_state_dict()
        want = ref.state_dict()
        assert sorted(own) == sorted(want), sorted(set(own) ^ set(want))
        for name, t in own.items():
            torch.testing.assert_close(
                t, want[name].detach(), rtol=0, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
            )
    layouts = {i.name: str(i.value.layout) for i in pm.graph().inputs if i.kind == "param"}
    out: dict[str, Any] = {
        "worst_grad_abs_diff": worst,
        "loss": float(loss),
        "layouts": layouts,
        "report": pm.plan_report(),
        "mesh": (tuple(pm.mesh.mesh_dim_names or ()), tuple(pm.mesh.mesh.shape)),
        # NOTE: (collective, axis, operands) of every bucketed collective the program runs
        "buckets": [
            (op.name, op.kwarg("axis"), len(op.operands)) for op in pm.graph().ops if op.name.endswith("_bucket")
        ],
    }
    if backend == "inductor":  # NOTE: what Inductor compiled, how long it took, and how often each ran
        low = pm._mf_programs.first.lowered
        out["compiled"] = [(m.what, m.seconds, m.calls) for m in (low.forward, low.backward)]
    if windows:
        out["windows"] = overlap
    if keep_module:
        out["module"] = pm
    return out


def _trained(pm: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One forward and backward of ``pm``; the loss."""
    loss = pm(*inputs)
    loss.backward()
    return loss


def assert_step_matches(
    pm: torch.nn.Module,
    loss: torch.Tensor,
    ref: torch.nn.Module,
    ref_loss: torch.Tensor,
    stacks: tuple[ParamStack, ...] = (),
    step: int = 0,
) -> float:
    """After one forward + backward of the compiled module ``pm`` (``loss``) and of the single-device
    model ``ref`` (``ref_loss``): the losses and every gradient agree; returns the largest gradient
    difference."""
    torch.testing.assert_close(
        loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} loss: {m}"
    )
    ref_grads = _as_compiled(ref, stacks, "grad")
    worst = 0.0
    for name, p in pm.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        full = p.grad.full_tensor()
        want = ref_grads[name]
        torch.testing.assert_close(full, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"step {step} grad {n}: {m}")
        worst = max(worst, float((full - want).abs().max()))
    return worst


def _as_compiled(model: torch.nn.Module, stacks: tuple[ParamStack, ...], what: str) -> dict[str, torch.Tensor]:
    """The single-device model's parameters (``what="param"``) or gradients (``"grad"``) as the compiled
    model names them: the same FQNs, except experts folded from an nn.ModuleList, which are stacked."""
    own: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach() if what == "param" else p.grad
        assert t is not None, f"the single-device model's {name} has no gradient"
        own[name] = t
    return as_stacked(stacks, own)


def reference_experts(model: torch.nn.Module, moe: dict[str, Any] | None) -> contextlib.AbstractContextManager[Any]:
    """With token dropping, the single-device reference drops the same way (the experts op with the
    same capacity); dropless, the model runs its own experts code."""
    if moe is None or moe.get("capacity_factor") is None:
        return contextlib.nullcontext()
    return experts_as_ops(model, MoeSpec.of(moe))


def verify_mode(
    model: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    plan: Any,
    corrupt: str = "",
    moe: Any = None,
    cp: Any = None,
) -> str:
    """``verify=True`` on a correct compilation passes; with one rank's shard of ``corrupt`` perturbed,
    every rank raises the same error naming the first value that differs. Returns the error text."""
    from meshfold.runtime.crosscheck import VerificationError

    warnings.filterwarnings("ignore")
    mesh = device_mesh(tuple(shape), tuple(names))
    net, inputs = build(model)
    with shared_capture(f"zoo:{model}"):
        pm = parallelize(net, mesh, inputs, plan=plan, verify=True, moe=moe, cp=cp)
    if corrupt and torch.distributed.get_rank() == 1:
        with torch.no_grad():
            dict(pm.named_parameters())[corrupt].to_local().add_(1.0)
    try:
        loss = pm(*inputs)
        loss.backward()
        pm(*inputs).backward()  # NOTE: the second step is not verified and must not raise
    except VerificationError as e:
        return str(e)
    return ""


def decorated(plan: str = "fsdp") -> float:
    """``@parallelize(mesh=..., plan=...)`` on a subclass: FQNs, loss and gradients as single device."""
    from meshfold import parallelize as par
    from meshfold.tools.zoo.models import MLP

    warnings.filterwarnings("ignore")
    mesh = device_mesh((2,), ("dp",))

    @par(mesh=mesh, plan=plan)
    class Net(MLP):
        pass

    torch.manual_seed(0)
    net = Net()
    torch.manual_seed(0)
    ref = MLP()
    _, inputs = build("mlp")
    loss = net(*inputs)
    loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters())
    assert [n for n, _ in net.named_parameters()] == list(ref_params)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=RTOL, atol=ATOL)
    return float(loss)


def decorated_usual_order() -> float:
    """The usual training-script order on a decorated class: construct, ``isinstance``, build the
    optimizer from ``net.parameters()``, then train; every step equals single device. Without
    example inputs, asking for the parameters before the first call says what to do."""
    from meshfold import parallelize as par
    from meshfold.passes import PassError
    from meshfold.tools.zoo.models import MLP

    warnings.filterwarnings("ignore")
    mesh = device_mesh((2,), ("dp",))
    _, inputs = build("mlp")

    @par(mesh=mesh, plan="fsdp", example_inputs=inputs)
    class Net(MLP):
        pass

    @par(mesh=mesh, plan="fsdp")
    class LazyNet(MLP):
        pass

    lazy = LazyNet()
    assert isinstance(lazy, LazyNet) and isinstance(lazy, MLP)
    try:
        lazy.parameters()
    except PassError as e:
        assert "example_inputs" in str(e), e
    else:
        raise AssertionError("parameters() before the first call must raise")
    torch.manual_seed(0)
    net = Net()
    assert isinstance(net, Net) and isinstance(net, MLP) and type(net).__name__ == "Net"
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    torch.manual_seed(0)
    ref = MLP()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        losses = []
        for o, model in ((opt, net), (ref_opt, ref)):
            o.zero_grad()
            loss = model(*inputs)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters())
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[name].detach(), rtol=RTOL, atol=ATOL)
    return float(net(*inputs))


def hf_equivalence(arch: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, layers: int = 2) -> float:
    """One step of an HF model from ``tests.dist.hf_models`` (4 sequences of 16 tokens): loss and every
    gradient as single device, the parameters named as the model names them."""
    from tests.dist.hf_models import build_hf

    warnings.filterwarnings("ignore")
    mesh = device_mesh(tuple(shape), tuple(names))
    net, inputs = build_hf(arch, layers)
    ref, _ = build_hf(arch, layers)
    with shared_capture(f"hf:{arch}"):
        pm = parallelize(net, mesh, inputs, plan=plan)
    assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()]
    loss = _trained(pm, inputs)
    assert_step_matches(pm, loss, ref, _trained(ref, inputs))
    return float(loss)


def token_inputs(tokens: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` of ``tokens`` (batch, sequence) over the zoo's vocabulary of 256, seeded."""
    ids = torch.randint(0, 256, tokens, generator=torch.Generator().manual_seed(0))
    return ids, ids.clone()


def mlp_recomputed_attention_offloaded(saved: Saved) -> str:
    """A per-value memory policy (``parallelize(memory=fn)``): the MLPs' activations recomputed, the
    attentions' offloaded, the rest saved."""
    if ".mlp" in saved.module and saved.recomputable:
        return "recompute"
    return "offload" if ".self_attn" in saved.module else "save"
