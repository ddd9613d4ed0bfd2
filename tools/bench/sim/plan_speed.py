"""How long the whole ``meshfold plan`` process takes (start-up included), as a user runs it.

    python -m meshfold.tools.bench.sim.plan_speed

Times, each as a fresh process (median of ``--repeat`` runs):

1. Llama3-8B dimensions (32 layers, vocab 128256) on ``--mesh dp=8,tp=8`` of h100:8x8, seq 2048;
2. Llama3-70B dimensions (80 layers), same mesh and cluster; goal: <= 1.3x the 32-layer time;
3. Llama3-405B dimensions with ``--fixed tp=8,pp=2,dp=1024`` on h100:8x2048, seq 4096; goal <= 60 s;
4. Llama3-8B searched over every mesh of h100:8x8 (no ``--mesh``);
5. DeepSeek-V3 dimensions (61 layers, 256 routed experts) searched over every mesh of 10,240 H100
   (h100:8x1280), seq 4096, global batch 15360: about a million configurations; goal <= 10 s.

Goal for (1): <= 5 s. For scale, REFERENCES.md measured autoparallel at about 3 minutes for (1) on
a machine like ours. Prints the load average beside the figures; exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

RUNS = {
    "8b-mesh": ["--model", "llama3-8b", "--cluster", "h100:8x8", "--seq", "2048", "--mesh", "dp=8,tp=8"],
    "70b-mesh": ["--model", "llama3-70b", "--cluster", "h100:8x8", "--seq", "2048", "--mesh", "dp=8,tp=8"],
    "405b-fixed": [
        "--model",
        "llama3-405b",
        "--cluster",
        "h100:8x2048",
        "--seq",
        "4096",
        "--global-batch",
        "2048",
        "--fixed",
        "tp=8,pp=2,dp=1024",
    ],
    "8b-search": ["--model", "llama3-8b", "--cluster", "h100:8x8", "--seq", "2048"],
    "dsv3-10k": ["--model", "deepseek-v3", "--cluster", "h100:8x1280", "--seq", "4096", "--global-batch", "15360"],
}


def _time(args: list[str], repeat: int) -> tuple[float, str]:
    times, out = [], ""
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "meshfold.tools.cli", "plan", *args, "--json"],
            capture_output=True,
            text=True,
            check=False,
        )
        times.append(time.perf_counter() - start)
        if proc.returncode:
            raise SystemExit(f"meshfold plan {' '.join(args)} failed:\n{proc.stderr}")
        out = proc.stdout.strip()
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    got = {}
    for name, cmd in RUNS.items():
        got[name] = _time(cmd, args.repeat)
        print(f"{name:11s} {got[name][0]:7.2f} s  (load {os.getloadavg()[0]:.2f})  {got[name][1]}")
    ratio = got["70b-mesh"][0] / got["8b-mesh"][0]
    print(f"80 layers / 32 layers: {ratio:.2f}x")
    ok = got["8b-mesh"][0] <= 5.0 and ratio <= 1.3 and got["405b-fixed"][0] <= 60.0 and got["dsv3-10k"][0] <= 10.0
    print(
        "goals (8B <= 5 s, 80/32 layers <= 1.3x, 405B fixed <= 60 s, DeepSeek-V3 on 10,240 <= 10 s):",
        "met" if ok else "MISSED",
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
