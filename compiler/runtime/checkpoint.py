"""Checkpoints that hold a step up only while they copy, and are never loaded half-written.

``pm.checkpoint(root, step, optimizer=...)`` copies the module's shards, the optimizer's state, the
programs' random generator and the host's (and any tensors the caller adds, such as a data
position) to host memory, and writes them with ``torch.distributed.checkpoint.async_save`` from a
thread of its own, on a gloo group of its own (so the write's collectives never interleave with the
step's). Each checkpoint is the folder ``root/step-00000012``; when every rank's part and DCP's
metadata are written, rank 0 adds ``COMPLETE.json`` there (written to a temporary name, then
renamed, so it is whole or absent). ``latest`` only ever answers a folder with that marker: a
checkpoint a failure cut short is skipped, whatever else it holds.

``pm.resume(root, optimizer=...)`` loads the newest complete checkpoint into a module compiled for
any mesh (DCP reshards: a checkpoint written by 4 ranks under one plan loads on 3 under another) and
returns the step it was taken at, or None when there is none. The marker is JSON read with
``json.loads``; nothing of a checkpoint is unpickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

MARKER = "COMPLETE.json"
_FOLDER = re.compile(r"step-(\d{8})")


@dataclass(frozen=True, slots=True)
class Saved:
    """A complete checkpoint: its folder, the step it was taken after, and the mesh that wrote it."""

    path: Path
    step: int
    world: int
    mesh: tuple[tuple[str, int], ...]


def folder(root: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return Path(root) / f"step-{step:08d}"


def latest(root: str | os.PathLike[str]) -> Saved | None:
    """The newest complete checkpoint under ``root`` (one with its marker), or None.

    A folder without the marker (a write a failure cut short) or with a marker that does not parse
    as ours is never answered."""
    base = Path(root)
    return max(_all_complete(base), key=lambda s: s.step, default=None) if base.is_dir() else None


def _read_marker(path: Path, step: int) -> Saved | None:
    try:
        data = json.loads((path / MARKER).read_text())
        if int(data["step"]) != step:
            return None
        mesh = tuple((str(n), int(s)) for n, s in data["mesh"])
        return Saved(path, step, int(data["world"]), mesh)
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Checkpointer:
    """One module's asynchronous checkpoints: at most one write in flight, older ones pruned.

    ``keep``: how many complete checkpoints stay under a root (the newest); folders a failure cut
    short are removed when a newer one completes."""

    def __init__(self, timeout: timedelta | None = None, keep: int = 2) -> None:
        self.keep = keep
        self._timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._pending: Future[Any] | None = None

    def _ensure_group(self) -> dist.ProcessGroup:
        # NOTE: collective (every rank calls save at the same step); gloo, since DCP's async save
        # plans and finishes on a CPU group, and one of its own keeps those off the step's groups.
        if self._group is None:
            kwargs = {"timeout": self._timeout} if self._timeout is not None else {}
            self._group = dist.new_group(backend="gloo", **kwargs)
        return self._group

    def save(
        self,
        module: nn.Module,
        root: str | os.PathLike[str],
        step: int,
        optimizer: torch.optim.Optimizer | None = None,
        state: dict[str, torch.Tensor] | None = None,
    ) -> Future[Any]:
        """Start writing ``step``'s checkpoint; returns once the state is copied to host memory.

        Waits for the previous write first (one in flight at a time). The future resolves when this
        rank's part is written (on rank 0: and the marker)."""
        self.wait()
        group = self._ensure_group()
        path = folder(root, step)
        # NOTE: a folder of this step already there is a write a failure cut short (a complete one
        # would have been resumed from): it is written over in place, and what only the old world
        # wrote is removed once the new write is complete (``_complete``), with no barrier here.
        written = dcp.async_save(_state(module, optimizer, state), checkpoint_id=str(path), process_group=group)
        marker = _marker(module, step) if dist.get_rank() == 0 else None
        # NOTE: our own future, resolved only once the marker is in place (DCP's done callbacks may
        # still be running when its own waiters wake).
        done: Future[Any] = Future()
        written.add_done_callback(lambda f: self._complete(f, done, path, Path(root), marker))
        self._pending = done
        return done

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; raises what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _complete(
        self, written: Future[Any], done: Future[Any], path: Path, root: Path, marker: dict[str, Any] | None
    ) -> None:
        try:
            result = written.result()
            if marker is not None:
                _drop_other_worlds(path, marker["world"])
                tmp = path / f".{MARKER}.tmp"
                tmp.write_text(json.dumps(marker))
                os.replace(tmp, path / MARKER)
                self._prune(root, marker["step"])
        except BaseException as e:  # NOTE: handed to whoever waits on the checkpoint
            done.set_exception(e)
        else:
            done.set_result(result)

    def _prune(self, root: Path, newest: int) -> None:
        complete = sorted(s.step for s in _all_complete(root))
        keep = set(complete[-self.keep :])
        for entry in root.iterdir():
            m = _FOLDER.fullmatch(entry.name)
            if m is None or int(m.group(1)) in keep:
                continue
            if int(m.group(1)) < newest:
                shutil.rmtree(entry, ignore_errors=True)


def _drop_other_worlds(path: Path, world: int) -> None:
    """Remove the shard files of ranks beyond ``world`` (left by a cut-short write of a larger world)."""
    for f in path.glob("__*_*.distcp"):
        rank = f.name[2:].split("_", 1)[0]
        if rank.isdigit() and int(rank) >= world:
            f.unlink()


def _all_complete(root: Path) -> list[Saved]:
    """Every checkpoint folder under ``root`` whose marker is in place and ours."""
    out = []
    for entry in root.iterdir():
        m = _FOLDER.fullmatch(entry.name)
        saved = _read_marker(entry, int(m.group(1))) if m is not None and (entry / MARKER).is_file() else None
        if saved is not None:
            out.append(saved)
    return out


def _marker(module: nn.Module, step: int) -> dict[str, Any]:
    mesh = module.mesh  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names or tuple(f"d{i}" for i in range(mesh.ndim))
    return {
        "step": step,
        "world": dist.get_world_size(),
        "mesh": [[n, int(s)] for n, s in zip(names, mesh.shape, strict=True)],
        "written": time.time(),
    }


def _rng(module: nn.Module) -> torch.Generator | None:
    return getattr(module, "_mf_rng", None)


def _state(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, torch.Tensor] | None
) -> dict[str, Any]:
    """What a checkpoint holds, every leaf a tensor (so loading unpickles nothing)."""
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(module, optimizer)
    else:
        model_sd, optim_sd = get_model_state_dict(module), {}
    rng = _rng(module)
    out: dict[str, Any] = {
        "model": model_sd,
        "optim": optim_sd,
        "host_rng": torch.get_rng_state(),
        "state": dict(state or {}),
    }
    if rng is not None:
        out["rng"] = rng.get_state()
    return out


def resume(
    module: nn.Module,
    root: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Saved | None:
    """Load the newest complete checkpoint under ``root`` into ``module`` (and ``optimizer``, and
    ``state``'s tensors in place), resharded to the module's mesh; restore the random generators.
    Returns the checkpoint, or None (nothing loaded) when there is none. Collective: rank 0 picks
    the checkpoint, so every rank loads the same one."""
    pick: list[Any] = [None]
    if dist.get_rank() == 0:
        found = latest(root)
        pick[0] = None if found is None else (str(found.path), found.step, found.world, found.mesh)
    dist.broadcast_object_list(pick, src=0)
    if pick[0] is None:
        return None
    path, step, world, mesh = pick[0]
    want = _state(module, optimizer, state)
    if optimizer is None:
        del want["optim"]
    dcp.load(want, checkpoint_id=path)
    if optimizer is not None:
        set_state_dict(module, optimizer, model_state_dict=want["model"], optim_state_dict=want["optim"])
    else:
        set_model_state_dict(module, want["model"])
    # NOTE: ``state``'s own tensors were filled in place by the load.
    torch.set_rng_state(want["host_rng"])
    rng = _rng(module)
    if rng is not None and "rng" in want:
        rng.set_state(want["rng"])
    return Saved(Path(path), int(step), int(world), tuple((n, s) for n, s in mesh))
