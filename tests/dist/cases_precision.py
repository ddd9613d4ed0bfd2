"""Tasks for tests/dist/test_precision.py: mixed-precision policies against the single-device model
under the same policy (fp32 master weights, bf16 compute), and beside torch's FSDP2
``fully_shard(mp_policy=...)`` with tensor parallelism on the same ranks.

bf16 keeps 8 significant bits: rounding to it moves a value by at most ``U = 2^-8`` of itself."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfold.api import parallelize
from meshfold.passes.options import DEFAULT_PIPELINE
from meshfold.passes.sharding.report import comm_summary
from meshfold.tools.bench.eager_vs_dtensor import Config, _dtensor_model
from meshfold.tools.bench.eager_vs_dtensor import build as build_bench
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build

U = 2.0**-8
"""bf16's unit roundoff (round to nearest, 8 significant bits)."""


def policy_step(
    model: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype = torch.bfloat16
) -> tuple[float, dict[str, torch.Tensor]]:
    """One device under the policy: ``model``'s floating parameters cast to ``dtype`` for the forward
    and backward (the cast is differentiated, so each gradient lands in fp32 on the fp32 parameter),
    floating inputs cast too; the loss and each parameter's gradient."""
    model.zero_grad()
    low = {n: p.to(dtype) for n, p in model.named_parameters()}
    cast = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    loss = torch.func.functional_call(model, low, cast)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def _step(pm: nn.Module, inputs: tuple[Any, ...]) -> tuple[float, dict[str, torch.Tensor]]:
    for p in pm.parameters():
        p.grad = None
    loss = pm(*inputs)
    loss.backward()
    return float(loss), {n: p.grad.full_tensor() for n, p in pm.named_parameters()}


def gather_bytes(pm: Any) -> float:
    """Bytes this rank sends per step in all-gathers of its program (``comm_summary``)."""
    return sum(c.bytes_per_rank for c in comm_summary(pm.graph()) if "all_gather" in c.op)


def fsdp_sums(precision: str) -> dict[str, Any]:
    """mlp on 4 ranks, fsdp on dp, under ``precision`` ("bf16": reduce in fp32, "bf16-reduce": in bf16).

    Each rank computes its quarter of the batch as one device computes that quarter (same shapes,
    same bf16 kernels), so its gradient is the single-device policy gradient of its slice, scaled by
    1/4 (the global mean's seed, exact in binary). Reduced in fp32, the program's gradient is then the
    fp32 sum of those four to fp32 rounding. Reduced in bf16 it is that sum rounded to bf16: every
    element is a bf16 value, within ``U`` of the fp32 sum plus fp32 rounding. Against the one-device
    step on the whole batch, which rounds the whole sum once instead of each quarter, both lie within
    ``U * (sum_r |g_r| + |g|)`` (+ ``U |sum|`` for the bf16 reduction), element by element."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((4,), ("dp",))
    net, _ = build("mlp")
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(256, 32, generator=g), torch.randn(256, 16, generator=g))  # NOTE: a batch worth splitting
    ref = copy.deepcopy(net)
    plain = parallelize(copy.deepcopy(net), mesh, inputs, plan="fsdp")
    pm = parallelize(net, mesh, inputs, plan="fsdp", precision=precision)
    loss, grads = _step(pm, inputs)
    whole_loss, whole = policy_step(ref, inputs)
    parts = [policy_step(ref, tuple(x[64 * r : 64 * r + 64] for x in inputs))[1] for r in range(4)]
    said: dict[str, Any] = {
        "parameters": sorted({str(p.dtype) for p in pm.parameters()}),
        "gradients": sorted({str(g.dtype) for g in grads.values()}),
        "loss within 3U": abs(loss - whole_loss) <= 3 * U * abs(whole_loss),
        "gather bytes ratio": gather_bytes(pm) / gather_bytes(plain),
        "bf16 values": all(bool((g == g.bfloat16().float()).all()) for g in grads.values()),
    }
    sums_fp32, bounds, ok_sum, ok_whole = {}, {}, True, True
    for name, g in grads.items():
        quarter = [p[name] / 4 for p in parts]
        s = sum(quarter)
        sums_fp32[name] = s
        near = 2.0**-20 * float(s.abs().max()) + 1e-12
        off = (g - s).abs()
        if precision == "bf16-reduce":
            ok_sum &= bool((off <= U * s.abs() + near).all())
        else:
            ok_sum &= bool((off <= near).all())
        bound = U * (sum(q.abs() for q in quarter) + whole[name].abs()) + U * s.abs() + near
        ok_whole &= bool(((g - whole[name]).abs() <= bound).all())
        bounds[name] = float(((g - whole[name]).abs() / bound).max())
    said["equals the sum of the slices"] = ok_sum
    said["within the bound of the whole batch"] = ok_whole
    said["worst share of the bound"] = max(bounds.values())
    return said


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest error of any gradient, relative to that gradient's largest element."""
    return max(float((got[n] - w).abs().max()) / max(float(w.abs().max()), 1e-30) for n, w in want.items())


def _normwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest relative error of any gradient as a whole, ``|got - want| / |want|`` (Frobenius)."""
    return max(float((got[n] - w).norm() / w.norm().clamp_min(1e-30)) for n, w in want.items())


def tp_errors(model: str = "llama-tiny") -> dict[str, Any]:
    """``model`` on (dp=2, tp=2) under fsdp+tp and precision="bf16" against one device under the same
    policy, beside how far that one-device step is from fp32 (errors as whole tensors, ``_normwise``).
    The program rounds every value the one-device step rounds, the same way, except where the plan
    splits a sum: a row-parallel product (and what is added to it before its all-reduce) is rounded
    on each tp rank and again by its bf16 all-reduce, a gradient on each dp rank before its fp32
    reduction: at most one rounding more of those values, where bf16 rounds every op's result once
    more than fp32 does. To first order the program is then no further from the policy step than
    twice the policy step's distance from fp32; and it is at least half that distance from fp32
    (it computes in bf16: an fp32 program would be nearly at fp32)."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    net, inputs = build(model)
    ref = copy.deepcopy(net)
    pm = parallelize(net, mesh, inputs, plan="fsdp+tp", precision="bf16")
    loss, grads = _step(pm, inputs)
    want_loss, want = policy_step(ref, inputs)
    ref.zero_grad()
    fp32 = ref(*inputs)
    fp32.backward()
    exact = {n: p.grad.clone() for n, p in ref.named_parameters()}
    return {
        "parameters": sorted({str(p.dtype) for p in pm.parameters()}),
        "loss error": abs(loss - want_loss) / abs(want_loss),
        "loss error of bf16": abs(float(fp32) - want_loss) / abs(want_loss),
        "error": _worst(grads, want),
        "error of bf16": _worst(exact, want),
        "error from fp32": _worst(grads, exact),
        "normwise": _normwise(grads, want),
        "normwise of bf16": _normwise(exact, want),
        "normwise from fp32": _normwise(grads, exact),
    }


SMALL = Config(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, seq=32, batch=4)


def beside_fsdp2(steps: int = 50) -> dict[str, Any]:
    """``steps`` AdamW steps of the bench's Llama (small) on (dp=2, tp=2) three ways under bf16
    parameters and fp32 reduction: meshfold ``precision="bf16"``, torch's FSDP2
    ``fully_shard(mp_policy=MixedPrecisionPolicy(bf16, fp32))`` with DTensor TP (the torchtitan
    recipe), and one device under the same policy (``policy_step``); the loss of every step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, inputs = build_bench(SMALL)
    single, torch_side = copy.deepcopy(model), copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pm = parallelize(model, mesh, inputs, plan="fsdp+tp", precision=policy)
    fs = _dtensor_model(torch_side, mesh, "replicate", mp_policy=policy)
    dp_rank = mesh["dp"].get_local_rank()
    local = tuple(x.chunk(2, dim=0)[dp_rank].contiguous() for x in inputs)
    opts = [torch.optim.AdamW(m.parameters(), lr=SMALL.lr) for m in (pm, fs, single)]
    curves: dict[str, list[float]] = {"meshfold": [], "fsdp2": [], "single": []}
    for _ in range(steps):
        for o in opts:
            o.zero_grad()
        loss = pm(*inputs)
        loss.backward()
        curves["meshfold"].append(float(loss))
        theirs = fs(*local)
        theirs.backward()
        mean = theirs.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
        curves["fsdp2"].append(float(mean))
        curves["single"].append(policy_step(single, inputs)[0])
        for o in opts:
            o.step()
    return curves


def refusals() -> list[str]:
    """What ``parallelize`` says, on every rank before any collective, to a policy it cannot apply."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh((2,), ("dp",))
    said = []
    for model, opts in ((build("mlp")[0].to(torch.bfloat16), {}), (build("mlp")[0], {"verify": True})):
        try:
            parallelize(model, mesh, build("mlp")[1], precision="bf16", **opts)
            said.append("compiled")
        except ValueError as e:
            said.append(str(e))
    return said


def no_float8_host() -> str:
    """A float8 model on a host whose float8 matmul does not run (the probe answers so here): what
    ``parallelize`` says, on every rank."""
    from torchao.float8 import convert_to_float8_training

    from meshfold.backends import select

    warnings.filterwarnings("ignore")
    mesh = device_mesh((2,), ("dp",))
    net = _Float8Mlp(64)
    convert_to_float8_training(net)
    real = select.float8_refusal
    select.float8_refusal = lambda device: "_scaled_mm is not supported on this device"
    try:
        parallelize(net, mesh, (torch.randn(8, 64), torch.randn(8, 64)), plan="fsdp")
    except ValueError as e:
        return str(e)
    finally:
        select.float8_refusal = real
    return "compiled"


class _Float8Mlp(nn.Module):
    """Two linears (no bias) under an mse loss, converted by torchao to ``Float8Linear``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.down(torch.relu(self.up(x))) - y) ** 2).mean()


def float8(
    shape: tuple[int, ...],
    names: tuple[str, ...],
    plan: str,
    recipe: str = "tensorwise",
    d: int = 256,
    verify: bool = False,
) -> dict[str, Any]:
    """torchao's float8 training (``convert_to_float8_training`` with ``recipe`` scaling) under
    ``plan`` against the same Float8Linear model on one device, beside how far float8 itself moves
    that model's gradients (the same model without the conversion), and where the weights live.

    Every float8 cast's scale comes from an amax the program reduces over every rank first (a max is
    exact), so each rank casts its values exactly as one device casts them; a product split over its
    contraction is summed in the gemm's output dtype: fp32 for the tensorwise recipe (fp32
    rounding), bf16 for the rowwise recipe's gradient gemms (each part rounded once more)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    warnings.filterwarnings("ignore")
    mesh = device_mesh(shape, names)
    torch.manual_seed(0)
    net = _Float8Mlp(d)
    plain = copy.deepcopy(net)
    convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(recipe))
    ref = copy.deepcopy(net)
    x, y = torch.randn(256, d), torch.randn(256, d)  # NOTE: a batch the fsdp solve keeps split
    unpassed = DEFAULT_PIPELINE.replace(",float8-gather", "")
    wide = parallelize(copy.deepcopy(net), mesh, (x, y), plan=plan, pipeline=unpassed)
    pm = parallelize(net, mesh, (x, y), plan=plan, verify=verify)
    loss, grads = _step(pm, (x, y))
    want = ref(x, y)
    want.backward()
    plain(x, y).backward()
    wants = {n: p.grad for n, p in ref.named_parameters()}
    graph = pm.graph()
    return {
        "loss error": abs(loss - float(want)) / abs(float(want)),
        "error": _worst(grads, wants),
        "error of float8": _worst({n: p.grad for n, p in plain.named_parameters()}, wants),
        "normwise": _normwise(grads, wants),
        "normwise of float8": _normwise({n: p.grad for n, p in plain.named_parameters()}, wants),
        "layouts": {i.name: str(i.value.layout) for i in graph.inputs if i.kind == "param"},
        "scaled mm": sum(op.name == "aten._scaled_mm" for op in graph.ops),
        "gathered": sorted({str(v.type.dtype) for op in graph.ops if "all_gather" in op.name for v in op.operands}),
        "gather bytes": gather_bytes(pm),
        "gather bytes without float8 gathers": gather_bytes(wide),
    }
