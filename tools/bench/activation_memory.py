"""Activations under a memory budget: meshfold's ``memory`` pass against torch's min-cut partitioner.

    python -m meshfold.tools.bench.activation_memory                       # 4 layers, hidden 256, batch 8 x seq 256
    python -m meshfold.tools.bench.activation_memory --layers 2 --seq 64 --png peak.png

One process, one gloo rank (mesh ``dp=1``: the whole model on one device, so both sides run the same
computation), the Llama-style model of ``eager_vs_dtensor``, one thread. Two curves of measured peak
against budget:

* meshfold: ``parallelize(..., memory=B)`` for budgets ``B`` = resident bytes (parameters,
  gradients, the AdamW state the estimate counts) + a fraction of the keep-everything program's
  predicted activation peak (read from a first compile without a budget), then ``memory="full"``
  and ``memory="offload"`` (every saved activation through the file tier: no recompute);
* torch: ``torch.compile(backend="aot_eager_decomp_partition")`` (AOTAutograd with its min-cut
  rematerialization partitioner, no Inductor) at each ``activation_memory_budget`` from 1.0 to 0.0.

Per point: the measured peak of one forward + backward (the CPU allocator's own count of bytes
above what existed before the step, gradients set to None first, so they count on both sides),
the FLOPs of that step as ``torch.utils.flop_counter`` counts them (GEMMs and attention: what
recompute adds on top of the keep program shows as the difference), the median step time and the
load average. Then, for each meshfold budget, the torch point whose measured peak is the closest
at or under meshfold's: their recomputed FLOPs and step times side by side. ``--png`` draws both
curves (peak against budget fraction). Losses of both sides are checked against each other.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from meshfold.tools.bench.eager_vs_dtensor import Config, build, gloo_rank
from meshfold.tools.measure import allocator_accounting, peak_new_bytes

FRACTIONS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
TORCH_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)


def _measure(model: Any, ids: torch.Tensor, steps: int) -> dict[str, float]:
    """Peak, FLOPs and median time of ``model(ids, ids).backward()`` (after one warm-up step)."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, ids).backward()

    step()
    peak = peak_new_bytes(step)
    with FlopCounterMode(display=False) as counter:
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    loss = float(model(ids, ids))
    return {
        "peak": peak,
        "flops": counter.get_total_flops(),
        "step": statistics.median(times),
        "load": os.getloadavg()[0],
        "loss": loss,
    }


def _meshfold_points(cfg: Config, steps: int) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    from meshfold.api import parallelize
    from meshfold.passes.cost.liveness import rank_memory

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))

    def compiled(memory: int | str | None) -> Any:
        torch.manual_seed(0)
        net, (ids, _) = build(cfg)
        return parallelize(net, mesh, (ids, ids), plan="ddp", memory=memory), ids

    keep, ids = compiled(None)
    est = rank_memory(keep.graph())
    resident, transient = est.resident, est.peak_transient
    points = [{"budget": "keep", "fraction": 1.0, **_measure(keep, ids, steps)}]
    for f in FRACTIONS:
        try:
            pm, _ = compiled(int(resident + f * transient))
        except Exception as e:  # NOTE: a budget no recompute reaches: reported, the curve goes on
            print(f"meshfold budget {f:.0%}: {str(e).splitlines()[0][:160]}", file=sys.stderr)
            continue
        points.append({"budget": f"{f:.0%}", "fraction": f, **_measure(pm, ids, steps)})
    for policy in ("full", "offload"):
        pm, _ = compiled(policy)
        fraction = rank_memory(pm.graph()).peak_transient / transient
        points.append({"budget": policy, "fraction": fraction, **_measure(pm, ids, steps)})
    return points


def _torch_points(cfg: Config, steps: int) -> list[dict[str, Any]]:
    import torch._functorch.config as functorch_config

    points = []
    for b in TORCH_BUDGETS:
        torch._dynamo.reset()
        functorch_config.activation_memory_budget = b
        torch.manual_seed(0)
        net, (ids, _) = build(cfg)
        model = torch.compile(net, backend="aot_eager_decomp_partition")
        points.append({"budget": f"{b:.1f}", "fraction": b, **_measure(model, ids, steps)})
    return points


def _table(title: str, points: list[dict[str, Any]], keep: dict[str, Any]) -> None:
    print(f"\n{title}")
    print(f"{'budget':>8} {'peak MiB':>9} {'vs keep':>8} {'recompute GFLOP':>16} {'step ms':>8} {'load':>5}")
    for p in points:
        print(
            f"{p['budget']:>8} {p['peak'] / 2**20:9.1f} {p['peak'] / keep['peak']:8.2f} "
            f"{(p['flops'] - keep['flops']) / 1e9:16.2f} {1e3 * p['step']:8.1f} {p['load']:5.2f}"
        )


def _matched(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    print("\nmatched by measured peak (torch: the closest point at or under meshfold's peak, else the lowest)")
    print(f"{'meshfold':>8} {'torch':>6} {'peak MiB':>17} {'recompute GFLOP':>17} {'step ms':>15} {'time ratio':>10}")
    k_ours, k_theirs = ours[0], theirs[0]
    for p in ours[1:]:
        under = [t for t in theirs if t["peak"] <= p["peak"]]
        t = max(under, key=lambda t: t["peak"]) if under else min(theirs, key=lambda t: t["peak"])
        print(
            f"{p['budget']:>8} {t['budget']:>6} {p['peak'] / 2**20:8.1f} {t['peak'] / 2**20:8.1f} "
            f"{(p['flops'] - k_ours['flops']) / 1e9:8.2f} {(t['flops'] - k_theirs['flops']) / 1e9:8.2f} "
            f"{1e3 * p['step']:7.1f} {1e3 * t['step']:7.1f} {t['step'] / p['step']:10.2f}"
        )


def _plot(path: str, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    recompute = [p for p in ours if p["budget"] != "offload"]
    for label, pts, marker in (("meshfold memory=", recompute, "o"), ("torch activation_memory_budget", theirs, "s")):
        ax.plot([p["fraction"] for p in pts], [p["peak"] / 2**20 for p in pts], marker=marker, label=label)
    ax.set_xlabel("budget fraction (meshfold: of the keep program's activations)")
    ax.set_ylabel("measured peak of one step (MiB)")
    ax.invert_xaxis()
    ax.set_title("peak against budget, one rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per point")
    ap.add_argument("--port", type=int, default=29617)
    ap.add_argument("--png", help="write the peak-vs-budget curves here")
    args = ap.parse_args(argv)
    cfg = Config(
        layers=args.layers, hidden=args.hidden, intermediate=int(2.6875 * args.hidden), seq=args.seq, batch=args.batch
    )
    print(f"{cfg.layers} layers, hidden {cfg.hidden}, batch {cfg.batch} x seq {cfg.seq}; one rank, one thread")
    with gloo_rank(0, 1, args.port), allocator_accounting():
        ours = _meshfold_points(cfg, args.steps)
        theirs = _torch_points(cfg, args.steps)
    _table("meshfold (memory pass)", ours, ours[0])
    _table("torch (min-cut partitioner)", theirs, theirs[0])
    _matched(ours, theirs)
    worst = max(abs(p["loss"] - ours[0]["loss"]) for p in ours + theirs)
    print(f"\nlosses: every point within {worst:.2e} of meshfold's keep program")
    if args.png:
        _plot(args.png, ours, theirs)
    return 1 if worst > 1e-4 else 0


if __name__ == "__main__":
    raise SystemExit(main())
