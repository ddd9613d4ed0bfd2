"""Recompute and offload on one CUDA device: step time and peak against the eager model.

    python -m meshfold.tools.bench.offload_gpu                 # hidden 1024 and 2048, 64 x 64 tokens
    python -m meshfold.tools.bench.offload_gpu --hidden 4096 --batch 32

One process, one NCCL rank (mesh ``dp=1``), the zoo's two-layer Llama-style model in fp32 at each
``--hidden`` (intermediate 4x). Per row: the eager model, then ``parallelize`` with every
activation kept, ``memory="full"`` and ``memory="offload"`` (pinned host memory on a copy stream,
``backends/host_tier.py``; planned for this GPU, so the overlap pass starts each reload ahead of its
reader), and ``offload-at-use``: the same planned as if the device had no copy engine (cluster
``cpu``), each reload issued where its reader is: the median step time (forward + backward, synchronized) of ``--steps``
after three warm-ups, the allocator's peak above what was live before the step, and both as ratios
to the eager model measured in the same run, with the load average. Figures are printed, never
asserted. Needs a CUDA device; says so and exits otherwise.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshfold.api import parallelize
from meshfold.tools.zoo.models import LlamaTiny

POLICIES = ("model", "keep", "full", "offload", "offload-at-use")


def measure(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple[float, int]:
    """Median seconds of a synchronized forward + backward, and the peak bytes above the start."""
    for _ in range(3):
        model(ids, ids).backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(ids, ids).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64, help="at most 64 (the model's rotary table)")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("offload_gpu: needs a CUDA device; none here")
        return 0
    warnings.filterwarnings("ignore")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
        ids = torch.randint(0, 256, (args.batch, args.seq), device="cuda")
        print(f"{torch.cuda.get_device_name()}, {args.batch} x {args.seq} tokens, fp32, median of {args.steps}")
        head = ("hidden", "program", "step ms", "vs model", "peak MiB", "vs model", "load")
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, (6, 14, 8, 8, 9, 8, 5), strict=True)))
        for hidden in args.hidden:
            base: tuple[float, int] | None = None
            for policy in POLICIES:
                torch.manual_seed(0)
                net = LlamaTiny(vocab=256, hidden=hidden, intermediate=4 * hidden).cuda()
                memory = None if policy == "keep" else policy.removesuffix("-at-use")
                cluster = "cpu:1x1" if policy.endswith("-at-use") else None
                if policy == "model":
                    model = net
                else:
                    model = parallelize(net, mesh, (ids, ids), plan="ddp", memory=memory, cluster=cluster)
                step, peak = measure(model, ids, args.steps)
                base = base or (step, peak)
                print(
                    f"{hidden:>6} {policy:>14} {1e3 * step:>8.2f} {step / base[0]:>8.2f} {peak / 2**20:>9.1f} "
                    f"{peak / base[1]:>8.2f} {os.getloadavg()[0]:>5.2f}"
                )
                del model, net
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
