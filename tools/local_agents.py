"""Elastic runs on one host: each "node" its own torchrun agent, so losing one leaves the others.

``LocalAgents(n)`` starts ``n`` agents of one rank each, joined by a c10d rendezvous on localhost
whose store this process hosts (as a cluster's etcd or store host would: an agent that dies takes
no one's rendezvous with it). ``kill(node)`` loses a node as a crashed host does (SIGKILL to its
agent and rank); ``stop(node)`` as a hung host does (SIGSTOP: alive, silent). The agents left
re-form on their own and torchrun restarts their ranks, which ``meshfold.train`` re-plans and
resumes (``meshfold.elastic``).

``python -m meshfold.tools.local_agents --model llama-tiny --steps 12 --every 3 --dir D --journal L`` is the
rank's program: a zoo model trained by ``meshfold.train`` on batches that are a function of the step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from meshfold.tools.ranks import free_port

BATCH = 12
"""Sequences a step: 12 divides among 4, 3 and 2 ranks alike."""
SEQ = 16


def batch_of(step: int, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the data position is the step: any world reads the same)."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    return ids, ids.clone()


def reference_losses(model: str, steps: int, lr: float) -> list[float]:
    """The single-device model trained ``steps`` AdamW steps on the same batches, uninterrupted."""
    from meshfold.tools.zoo import build

    net, _ = build(model)
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    out = []
    for step in range(steps):
        opt.zero_grad()
        loss = net(*batch_of(step))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@dataclass
class _Node:
    proc: subprocess.Popen[bytes]
    out: Path


class LocalAgents:
    """``nodes`` torchrun agents of one rank each on localhost (``min_nodes`` to ``nodes`` of them
    form a world), running ``python -m meshfold.tools.local_agents`` with ``args``."""

    def __init__(
        self,
        nodes: int,
        args: Sequence[str],
        workdir: str | os.PathLike[str],
        min_nodes: int = 2,
        max_restarts: int = 3,
        last_call_s: int = 4,
    ) -> None:
        from torch.distributed import TCPStore

        self.workdir = Path(workdir)
        self.port = free_port()
        # NOTE: the rendezvous store lives here, so no agent hosts it (is_host=false below)
        self._store = TCPStore("127.0.0.1", self.port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=60))
        conf = (
            f"is_host=false,last_call_timeout={last_call_s},"
            "keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"
        )
        self._cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={min_nodes}:{nodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            "--rdzv-id=meshfold-elastic",
            f"--rdzv-conf={conf}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2",
            "-m",
            "meshfold.tools.local_agents",
            *args,
        ]
        self.nodes: list[_Node] = []
        self._workers: list[int] = []
        # NOTE: a store per round, hosted by its rank 0 (see meshfold.elastic: a shared one dies
        # with the node that hosts it, and its per-restart prefixes differ across agents)
        env = os.environ | {
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        for i in range(nodes):
            out = self.workdir / f"node{i}.out"
            with out.open("wb") as f:
                proc = subprocess.Popen(self._cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self.nodes.append(_Node(proc, out))

    def kill(self, rank: int, log: str | os.PathLike[str]) -> tuple[int, float]:
        """Lose the node running ``rank`` now as a crashed host: SIGKILL its agent and its rank.
        Returns the node and when (``time.time()``)."""
        return self._signal(rank, log, signal.SIGKILL)

    def stop(self, rank: int, log: str | os.PathLike[str]) -> tuple[int, float]:
        """Hang the node running ``rank`` as a stuck host: SIGSTOP its agent and its rank (alive,
        never answering). Returns the node and when."""
        return self._signal(rank, log, signal.SIGSTOP)

    def _signal(self, rank: int, log: str | os.PathLike[str], sig: signal.Signals) -> tuple[int, float]:
        # NOTE: torchrun starts its ranks in sessions of their own, so the agent's group and the
        # rank (from its newest start event) are signalled each.
        start = [e for e in events(log) if e["event"] == "start" and e["rank"] == rank][-1]
        node = next((i for i, n in enumerate(self.nodes) if n.proc.pid == start["ppid"]), None)
        if node is None:
            raise LookupError(f"rank {rank}'s agent (pid {start['ppid']}) is not one of ours")
        at = time.time()
        os.killpg(self.nodes[node].proc.pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(start["pid"], sig)
        self._workers.append(start["pid"])
        return node, at

    def wait(self, timeout_s: float, skip: Sequence[int] = ()) -> dict[int, int]:
        """Each node's exit code but ``skip``'s, once all have exited (raises ``TimeoutError``)."""
        end = time.monotonic() + timeout_s
        codes: dict[int, int] = {}
        for i, node in enumerate(self.nodes):
            if i in skip:
                continue
            left = max(0.1, end - time.monotonic())
            try:
                codes[i] = node.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                tail = self.output(i)[-3000:]
                raise TimeoutError(f"node {i} still running after {timeout_s:.0f} s:\n{tail}") from None
        return codes

    def output(self, node: int) -> str:
        return self.nodes[node].out.read_text(errors="replace")

    def close(self) -> None:
        """Kill whatever is left (a stopped node too)."""
        for pid in self._workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for node in self.nodes:
            if node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.proc.pid, signal.SIGKILL)
                node.proc.wait()


def events(log: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON lines ``meshfold.train`` appended to ``log`` (none yet: empty)."""
    path = Path(log)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def wait_for_step(log: Path, step: int, timeout_s: float, world: int | None = None) -> None:
    """Block until some rank logs ``step`` done (in a world of ``world`` ranks, when given)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for e in events(log):
            if e["event"] == "step" and e["step"] >= step and (world is None or e["world"] == world):
                return
        time.sleep(0.1)
    raise TimeoutError(f"no rank reached step {step} within {timeout_s:.0f} s")


@dataclass(frozen=True, slots=True)
class Loss:
    """One node lost in a run: ``how`` ("kill": crashed, "stop": hung), once ``rank`` of the world of
    ``world`` ranks has logged step ``after_step``."""

    how: str
    world: int
    after_step: int
    rank: int


@dataclass
class Outcome:
    """What an elastic run logged, when each loss was made, and each surviving node's exit code."""

    events: list[dict[str, Any]]
    lost_at: list[float]
    codes: dict[int, int]


def lose_nodes(
    workdir: str | os.PathLike[str],
    losses: Sequence[Loss],
    *,
    nodes: int = 4,
    steps: int = 15,
    every: int = 3,
    timeout_s: float = 6.0,
    model: str = "llama-tiny",
    lr: float = 1e-2,
    step_sleep: float = 0.3,
    after_loss: Any = None,
    limit_s: float = 400.0,
) -> Outcome:
    """Train ``model`` on ``nodes`` local agents and lose a node at each of ``losses`` in turn; wait for
    the run to finish on the nodes left. ``after_loss(checkpoints)`` runs right after each loss."""
    work = Path(workdir)
    log, checkpoints = work / "events.jsonl", work / "checkpoints"
    args = ["--model", model, "--steps", str(steps), "--every", str(every), "--lr", str(lr)]
    args += ["--dir", str(checkpoints), "--journal", str(log), "--timeout", str(timeout_s)]
    args += ["--step-sleep", str(step_sleep)]
    agents = LocalAgents(nodes, args, work)
    lost: list[int] = []
    lost_at: list[float] = []
    try:
        end = time.monotonic() + limit_s
        for loss in losses:
            wait_for_step(log, loss.after_step, end - time.monotonic(), world=loss.world)
            node, at = (agents.kill if loss.how == "kill" else agents.stop)(loss.rank, log)
            lost.append(node)
            lost_at.append(at)
            if after_loss is not None:
                after_loss(checkpoints)
        codes = agents.wait(max(1.0, end - time.monotonic()), skip=lost)
    finally:
        agents.close()
    return Outcome(events(log), lost_at, codes)


def recoveries(outcome: Outcome) -> list[dict[str, float]]:
    """Per loss: seconds to detect it (first rank failing), to restart (first rank started in the
    smaller world), to plan and reload there (rank 0), from the loss to the first step after, and the
    steps lost (done before it, done again after)."""
    out = []
    for at in outcome.lost_at:
        failed = [e for e in outcome.events if e["event"] == "failed" and e["t"] >= at]
        if not failed:
            continue
        old = failed[0]["world"]
        after = [e for e in outcome.events if e["t"] > failed[0]["t"] and e["world"] < old]
        first = {kind: next(e for e in after if e["event"] == kind and e["rank"] == 0) for kind in ("start", "resumed")}
        planned = next(e for e in after if e["event"] == "planned" and e["rank"] == 0)
        step = next(e for e in after if e["event"] == "step")
        done = max(e["step"] for e in outcome.events if e["event"] == "step" and e["world"] == old and e["t"] < at)
        out.append(
            {
                "world": float(old),
                "detect_s": failed[0]["t"] - at,
                "restart_s": first["start"]["t"] - failed[0]["t"],
                "plan_s": planned["seconds"],
                "reload_s": first["resumed"]["seconds"],
                "to_first_step_s": step["t"] - at,
                "resumed_at": float(first["resumed"]["step"]),
                "steps_lost": float(done + 1 - first["resumed"]["step"]),
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of an elastic run (under torchrun): train a zoo model with ``meshfold.train``."""
    parser = argparse.ArgumentParser(prog="python -m meshfold.tools.local_agents", description=main.__doc__)
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--dir", required=True, help="where checkpoints go")
    parser.add_argument("--journal", required=True, help="JSON lines of events, every rank")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a collective waits for a peer")
    parser.add_argument("--plan", default="auto")
    parser.add_argument("--tp", type=int, default=0, help="a fixed plan's tp axis (with --plan)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of idle per step (pacing)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from meshfold.elastic import train
    from meshfold.tools.zoo import build

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if args.step_sleep:
            time.sleep(args.step_sleep)
        return batch_of(step)

    train(
        lambda: build(args.model)[0],
        batch,
        args.steps,
        args.dir,
        every=args.every,
        optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr),
        plan=args.plan,
        mesh={"tp": args.tp} if args.tp else None,
        log=args.journal,
        timeout=args.timeout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
