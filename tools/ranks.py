"""Local CPU ranks for the ``meshfold`` commands: spawn one process per rank (gloo), show rank 0's
stages, collect what each rank reports."""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stages:
    """Shows the stage a command is in: a spinner on a terminal, else one plain line per stage."""

    def __init__(self, console: Any, command: str) -> None:
        self._console = console
        self._command = command
        self._live: Any = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __call__(self, text: str) -> None:
        if not self._console.is_terminal:
            print(f"{self._command}: {text} ...", flush=True)
        elif self._live is None:
            self._live = self._stack.enter_context(self._console.status(text))
        else:
            self._live.update(text)


@dataclass(frozen=True)
class Reporter:
    """What a rank's body sends back: ``stage`` (rank 0's only are shown), ``result`` (one per rank)."""

    rank: int
    queue: Any

    def stage(self, text: str) -> None:
        if self.rank == 0:
            self.queue.put(("stage", self.rank, text))

    def result(self, payload: Any) -> None:
        self.queue.put(("result", self.rank, payload))


Body = Callable[[int, dict[str, Any], Reporter], None]


def _entry(rank: int, body: Body, world: int, port: int, args: dict[str, Any], queue: Any) -> None:
    # NOTE: rank 0 sends its stages to the parent's spinner; its compile logs instead of drawing a second one
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MESHFOLD_PROGRESS="log")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(rank, args, Reporter(rank, queue))
    finally:
        dist.destroy_process_group()


def on_ranks(body: Body, world: int, args: dict[str, Any], stages: Stages) -> dict[int, Any]:
    """Spawn ``world`` ranks, each running ``body(rank, args, reporter)`` in a joined gloo world (a
    module-level function: it is pickled to the spawned processes); show rank 0's stages; return
    each rank's result by rank."""
    queue = mp.get_context("spawn").SimpleQueue()
    stages(f"spawning {world} CPU ranks")
    procs = mp.start_processes(
        _entry, args=(body, world, free_port(), args, queue), nprocs=world, join=False, start_method="spawn"
    )
    results: dict[int, Any] = {}
    done = False
    while not done:
        done = procs.join(timeout=0.2)
        while not queue.empty():
            kind, rank, payload = queue.get()
            if kind == "stage":
                stages(payload)
            else:
                results[rank] = payload
    return results
