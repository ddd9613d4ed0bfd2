"""``meshfold.train``: a training loop that survives a lost rank.

Run it under ``torchrun`` with an elastic range (``--nnodes=2:4 --max-restarts=3``). When a rank dies
or stops answering, the others' next collective raises (``CollectiveError``: at once for a dead peer,
after ``timeout=`` for a stuck one), their processes exit, and torchrun restarts them on the ranks
that are left. Each start then does the same three things:

1. **plan** for the world it finds: ``plan="auto"`` chooses the mesh for the new rank count
   (``meshfold.world``); a fixed plan keeps its mesh's fixed axes (``mesh={"tp": 2}``: ``dp`` takes
   the rest) where they still divide the world, and otherwise raises, on every rank alike and
   before any collective, naming what no longer fits;
2. **reload** the newest complete checkpoint (``meshfold.runtime.checkpoint``), resharded to the new
   plan: weights, optimizer state, the random generators, and the data position, which is the step
   itself (``batch(step)`` gives the global batch of a step, whatever the world);
3. **train** on from there, checkpointing asynchronously every ``every`` steps.

So at most ``every`` steps are lost, and nothing half-written is ever read. ``log=`` appends one JSON
line per event (start, planned, resumed, step, checkpoint, failed) from every rank, with wall-clock
times, which is how the elastic bench measures detection, restart, re-plan and reload.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from meshfold.api import parallelize
from meshfold.backends.watch import CollectiveError
from meshfold.passes import PassError

Batch = Callable[[int], Sequence[Any]]
MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class Run:
    """What one start of ``train`` did: the world and mesh it planned for, the step it resumed from
    (0: no checkpoint), each step's loss, and how long planning and reloading took."""

    world: int
    mesh: tuple[tuple[str, int], ...]
    start: int
    losses: list[tuple[int, float]] = field(default_factory=list)
    plan_s: float = 0.0
    reload_s: float = 0.0


def mesh_for(world: int, fixed: Mapping[str, int]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The mesh a fixed plan gets on ``world`` ranks: ``dp`` outermost takes what ``fixed``'s axes
    leave. Raises ``PassError`` naming the axes when they do not divide the world."""
    for name, size in fixed.items():
        if name == "dp" or not isinstance(size, int) or size < 1:
            raise PassError(f"mesh={dict(fixed)}: give each axis but dp a positive size (dp takes the rest)")
    inner = math.prod(fixed.values())
    if world % inner:
        axes = " x ".join(f"{n}={s}" for n, s in fixed.items())
        raise PassError(
            f"the plan's mesh ({axes}, {inner} ranks a replica) no longer fits the {world} ranks there are now: "
            f"{world} is not a multiple of {inner}. Give axes that divide every world size the run may shrink "
            "to, or plan='auto', which chooses the mesh for the ranks there are"
        )
    return ("dp", *fixed), (world // inner, *fixed.values())


def train(
    build: Callable[[], nn.Module],
    batch: Batch,
    steps: int,
    checkpoints: str | os.PathLike[str],
    *,
    every: int = 10,
    optimizer: MakeOptimizer | None = None,
    plan: Any = "auto",
    mesh: Mapping[str, int] | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    log: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Run:
    """Train ``build()`` for ``steps`` steps on ``batch(step)``, resuming from the newest complete
    checkpoint under ``checkpoints`` and writing one every ``every`` steps (asynchronously).

    ``build``: the single-device model, seeded so every call gives the same weights (they are only
    used when there is no checkpoint yet). ``optimizer``: makes the optimizer from the parameters
    (default AdamW, lr 1e-3). ``plan``/``mesh``: ``plan="auto"`` (the default) chooses the mesh for
    the world; otherwise ``mesh`` names the fixed axes (``{"tp": 2}``) and ``plan`` is a preset for
    them. ``loss``: the loss from the model's output (default: the output is the loss). Every other
    keyword goes to ``parallelize`` (``timeout=``: how soon a stuck peer is given up on). Initializes
    ``torch.distributed`` from torchrun's environment when it is not yet."""
    _check_launcher()
    _init_process_group()
    world = dist.get_world_size()
    events = _Log(log, world)
    events.write("start", restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    started = time.perf_counter()
    example = tuple(batch(0))
    if plan == "auto" and mesh is None:
        pm = parallelize(build(), world, example, plan="auto", **options)
    else:
        if mesh is None:
            raise PassError(
                f"plan={plan!r}: give mesh= its fixed axes ({{'tp': 2}}; dp takes the rest), or plan='auto'"
            )
        names, sizes = mesh_for(world, mesh)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        pm = parallelize(build(), init_device_mesh(device, sizes, mesh_dim_names=names), example, plan=plan, **options)
    opt = (optimizer or _adamw)(pm.parameters())
    shape = tuple(zip(pm.mesh.mesh_dim_names or (), (int(s) for s in pm.mesh.shape), strict=True))
    plan_s = time.perf_counter() - started
    events.write("planned", mesh=shape, seconds=plan_s)
    started = time.perf_counter()
    start = pm.resume(checkpoints, optimizer=opt) or 0
    run = Run(world, shape, start, plan_s=plan_s, reload_s=time.perf_counter() - started)
    events.write("resumed", step=start, seconds=run.reload_s)
    try:
        for step in range(start, steps):
            opt.zero_grad()
            out = pm(*batch(step))
            value = out if loss is None else loss(out)
            value.backward()
            opt.step()
            run.losses.append((step, float(value)))
            events.write("step", step=step, loss=float(value))
            if (step + 1) % every == 0:
                held = time.perf_counter()
                pm.checkpoint(checkpoints, step + 1, optimizer=opt)
                events.write("checkpoint", step=step + 1, seconds=time.perf_counter() - held)
        pm.wait_checkpoint()
    except (CollectiveError, RuntimeError) as e:
        events.write("failed", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    events.write("done", step=steps)
    return run


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _check_launcher() -> None:
    """Warn where torchrun's restarts cannot re-form the ranks left after a node is lost."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):
        warnings.warn(
            "meshfold.train under torchrun with restarts: the ranks' store is the one the first rank-0 agent "
            "hosts for the whole run, so losing that node loses it, and agents that restarted a different number "
            "of times look for each other under different prefixes and never meet. Launch the agents with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store each round, hosted by that round's rank 0)",
            stacklevel=3,
        )


def _init_process_group() -> None:
    # NOTE: the default group keeps its own timeout: rank 0 plans while the others wait on it.
    # ``timeout=`` bounds the module's collectives and the checkpoints', where a stuck peer shows.
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")


class _Log:
    """JSON lines appended by every rank (one ``write`` each, so lines never interleave)."""

    def __init__(self, path: str | os.PathLike[str] | None, world: int) -> None:
        self.path = None if path is None else Path(path)
        self.rank = dist.get_rank()
        self.world = world

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        record = {"event": event, "rank": self.rank, "world": self.world, "pid": os.getpid(), "ppid": os.getppid()}
        record["t"] = time.time()
        line = json.dumps(record | fields) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
