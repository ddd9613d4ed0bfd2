"""Mixed precision: meshfold's bf16 policy against fp32 and against torch's FSDP2 + TP with the same
policy, step time and bytes on the wire by collective, in one run.

    python -m meshfold.tools.bench.mixed_precision                 # 4 gloo CPU ranks, (dp=2, tp=2), 8 layers
    python -m meshfold.tools.bench.mixed_precision --layers 2 --steps 4

Every side trains the benches' Llama-style model (``eager_vs_dtensor.BenchLlama``: same weights,
inputs and global batch) with AdamW on fp32 master weights:

1. ``meshfold bf16``: ``parallelize(..., plan="fsdp+tp", precision="bf16")`` (bf16 parameters for
   compute and all-gathers, fp32 gradient reduction);
2. ``meshfold fp32``: the same without a policy;
3. ``FSDP2+TP bf16``: DTensor TP and ``fully_shard(mp_policy=MixedPrecisionPolicy(bf16, fp32))``;
4. ``torchtitan bf16``: torchtitan's recipe (TP + sequence parallel, FSDP2 with prefetch,
   ``titan_recipe.titan_model``) with its default mixed-precision settings, the same policy;
5. ``meshfold float8``: side 1 with every linear but the LM head converted by torchao's
   ``convert_to_float8_training`` (tensorwise scaling), as torchtitan's float8 recipe does.

The sides' steps are interleaved (drift in machine load hits all alike); the median step after
warm-up, the collectives each rank dispatched in the first step by kind (bytes by ring volumes), and
meshfold's modelled peak memory per rank (``passes.cost.liveness``) are printed with the load
average, and the ratios against the other sides of the same run. The loss of every step is checked
against one device under the same policy. Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist

from meshfold.tools.bench.eager_vs_dtensor import (
    SIZES,
    Config,
    Side,
    _dtensor_model,
    _train,
    build,
    gloo_rank,
    spawn_ranks,
    trainer,
)
from meshfold.tools.bench.titan_recipe import titan_model

SIDES = ("meshfold bf16", "meshfold fp32", "FSDP2+TP bf16", "torchtitan bf16", "meshfold float8")


def _rank_main(rank: int, world: int, port: int, cfg_dict: dict[str, Any], opts: dict[str, Any], queue: Any) -> None:
    with gloo_rank(rank, world, port):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.tensor.parallel import loss_parallel

        from meshfold.api import parallelize
        from meshfold.passes.cost.liveness import rank_memory
        from meshfold.passes.sharding.report import comm_summary

        cfg = Config(**cfg_dict)
        mesh = init_device_mesh("cpu", tuple(opts["mesh"]), mesh_dim_names=("dp", "tp"))
        model, inputs = build(cfg)
        copies = [copy.deepcopy(model) for _ in range(4)]
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(copies[3], module_filter_fn=lambda _m, fqn: fqn != "lm_head")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
        local = tuple(x.chunk(dp, dim=0)[dp_rank].contiguous() for x in inputs)
        bf16 = parallelize(model, mesh, inputs, plan="fsdp+tp", precision="bf16")
        fp32 = parallelize(copies[0], mesh, inputs, plan="fsdp+tp")
        float8 = parallelize(copies[3], mesh, inputs, plan="fsdp+tp", precision="bf16")
        steps = [
            trainer(bf16, inputs, cfg)[0],
            trainer(fp32, inputs, cfg)[0],
            trainer(_dtensor_model(copies[1], mesh, "replicate", mp_policy=policy), local, cfg)[0],
            trainer(titan_model(copies[2], mesh, mp_policy=policy), local, cfg, loss_parallel)[0],
            trainer(float8, inputs, cfg)[0],
        ]
        sides = [Side(s) for s in steps]
        _train(sides, cfg.warmup + cfg.steps)
        losses = []
        for k, side in enumerate(sides):
            curve = torch.stack(side.losses)
            if k in (2, 3):  # NOTE: a torch side's loss is its dp rank's mean; their mean is the global loss
                dist.all_reduce(curve, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
            losses.append(curve.tolist())
        if rank == 0:
            queue.put(
                {
                    "times": [s.times[cfg.warmup :] for s in sides],
                    "kinds": [{k: (n, s.counter.bytes[k]) for k, n in s.counter.counts.items()} for s in sides],
                    "losses": losses,
                    "memory": [rank_memory(pm.graph()).peak for pm in (bf16, fp32, float8)],
                    "param_gathers": [param_gather_bytes(pm.graph()) for pm in (bf16, fp32, float8)],
                    "planned": [
                        {f"{c.op} {c.axis} {c.phase}": c.bytes_per_rank for c in comm_summary(pm.graph())}
                        for pm in (bf16, fp32)
                    ],
                    "load": os.getloadavg()[0],
                }
            )


def param_gather_bytes(graph: Any) -> float:
    """Bytes a rank sends per step in all-gathers of parameters (each operand a parameter input, the
    ``precision`` pass's cast of one, or the ``float8-gather`` pass's scaled float8 cast of one), by the
    wire volumes ``comm_summary`` uses."""
    from meshfold.ir import OpDef, TensorType

    aten = torch.ops.aten
    elementwise = (aten._to_copy.default, aten.clamp.default, aten.mul.Tensor)
    params = {i.value for i in graph.inputs if i.kind == "param"}
    made = graph.producers()

    def of_param(x: Any) -> bool:
        while x not in params and x in made and made[x].target in elementwise:
            x = made[x].operands[0]
        return x in params

    total = 0.0
    for op in graph.ops:
        if not (isinstance(op.target, OpDef) and "all_gather" in op.name):
            continue
        for x in op.operands:
            if of_param(x):
                assert isinstance(x.type, TensorType)
                total += op.target.wire_bytes_of(x.type, x.layout, graph.mesh, dict(op.kwargs))
    return total


def _single_device(cfg: Config) -> list[float]:
    """One device under the policy: bf16 copies of the fp32 parameters for each step's compute."""
    model, inputs = build(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    out = []
    for _ in range(cfg.warmup + cfg.steps):
        opt.zero_grad()
        low = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
        loss = torch.func.functional_call(model, low, inputs)
        loss.backward()
        opt.step()
        out.append(float(loss))
    return out


def _report(cfg: Config, r: dict[str, Any], ref: list[float]) -> None:
    mib = 2**20
    ms = [statistics.median(t) * 1e3 for t in r["times"]]
    print(
        f"model: bench Llama, {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}, batch {cfg.batch} x "
        f"seq {cfg.seq}; mesh dp=2 x tp=2 (4 gloo CPU ranks, 1 thread each); {cfg.warmup} warm-up + "
        f"{cfg.steps} timed steps; load average {os.getloadavg()[0]:.2f} (ranks' end {r['load']:.2f})\n"
    )
    kinds = sorted({k for side in r["kinds"] for k in side})
    w = 16
    print(f"{'':<28}" + "".join(f"{s:>{w}}" for s in SIDES))
    print(f"{'median step (ms)':<28}" + "".join(f"{m:>{w}.1f}" for m in ms))
    for k in kinds:
        cells = [side.get(k, (0, 0.0)) for side in r["kinds"]]
        print(f"{k + ' MiB/rank/step':<28}" + "".join(f"{b / mib:>{w}.3f}" for _, b in cells))
        print(f"{k + ' calls/step':<28}" + "".join(f"{n:>{w}d}" for n, _ in cells))
    memory = [*r["memory"][:2], None, None, r["memory"][2]]
    print(f"{'modelled peak MiB/rank':<28}" + "".join(f"{m / mib:>{w}.1f}" if m else f"{'-':>{w}}" for m in memory))
    devs = [max(abs(a - b) for a, b in zip(curve, ref, strict=True)) for curve in r["losses"]]
    print(f"{'max |loss - one device|':<28}" + "".join(f"{d:>{w}.1e}" for d in devs))
    print(
        "\nmeshfold's collectives by the program (comm_summary; gloo sends gathers and reduce-scatters as all-to-alls):"
    )
    for line in dict.fromkeys([*r["planned"][0], *r["planned"][1]]):
        b16, b32 = (p.get(line, 0.0) / mib for p in r["planned"])
        print(f"  {line:<36} bf16 {b16:8.3f} MiB  fp32 {b32:8.3f} MiB  ratio {b16 / b32 if b32 else float('nan'):.3f}")
    ag = r["param_gathers"]
    print(
        f"parameter all-gathers per step: bf16 {ag[0] / mib:.3f} MiB, fp32 {ag[1] / mib:.3f} MiB, "
        f"float8 {ag[2] / mib:.3f} MiB"
    )
    print(
        f"\nratios (same run, load {os.getloadavg()[0]:.2f}): meshfold bf16 step vs meshfold fp32 "
        f"{ms[1] / ms[0]:.2f}x faster, vs FSDP2+TP bf16 {ms[2] / ms[0]:.2f}x, vs torchtitan bf16 {ms[3] / ms[0]:.2f}x; "
        f"meshfold float8 vs meshfold bf16 {ms[0] / ms[4]:.2f}x; "
        f"parameter all-gather bytes bf16/fp32 {ag[0] / max(ag[1], 1.0):.3f}"
    )
    print(
        "one device under the policy: fp32 master weights, bf16 copies for compute (the loss curve compared; "
        "float8 rounds more, so its distance is float8's own)"
    )


def main(argv: list[str] | None = None) -> int:
    d = Config(layers=8)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=d.steps, help="timed steps")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first (the first counts bytes)")
    for size in SIZES:
        ap.add_argument(f"--{size.replace('_', '-')}", type=int, default=getattr(d, size))
    a = ap.parse_args(argv)
    sizes = {size: getattr(a, size) for size in SIZES}
    cfg = dataclasses.replace(d, warmup=max(a.warmup, 1), steps=a.steps, **sizes)
    result = spawn_ranks(_rank_main, 4, cfg, {"mesh": (2, 2)})
    _report(cfg, result, _single_device(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
