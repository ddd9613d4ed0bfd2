"""The worker side of ``meshfold.tools.pool``: the body each rank's process runs (join the gloo group,
then run tasks until told to stop or orphaned), and what a task running there may use (``device_mesh``)."""

from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# NOTE: these must be in the environment when the interpreter starts (PYTHONUNBUFFERED) or when torch is
# first imported (thread counts), so the parent sets them around ``Process.start``; 8 ranks share 2 cores.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
READY = -1
"""The task id of a rank's first message: it joined the process group (or failed to)."""
Fingerprint = tuple[int, dict[str, int]] | None
"""A rank's process-group state: groups made so far and the collectives issued in each."""


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """Inside a task: a CPU ``DeviceMesh`` of ``shape``/``names``, created once per worker and then reused.

    Each ``init_device_mesh`` call makes new gloo groups (threads and sockets that are never freed), so a
    session sending hundreds of cases should take its meshes from here. Every rank must ask for the same
    meshes in the same order, as with ``init_device_mesh``.
    """
    key = (tuple(shape), tuple(names))
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[key] = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
    return _MESHES[key]


# NOTE: worker-process state only (the parent never fills it); it lives exactly as long as the
# worker's process groups, so a cached mesh can never outlive its groups.
_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}


def worker_main(rank: int, world: int, tmpdir: str, path: list[str], conn: Connection) -> None:
    """Body of a worker process: join the gloo group, then run tasks until told to stop or orphaned."""
    sys.path[:] = path
    os.environ.update(WORKER_ENV)
    fd = os.open(os.path.join(tmpdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # NOTE: Ctrl-C reaches the whole process group; the parent handles it and kills the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGUSR1"):
        stacks = open(os.path.join(tmpdir, f"rank{rank}.stacks"), "a")  # noqa: SIM115 (lives as long as we do)
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # NOTE: a crash in native code (a kernel, gloo) kills the rank without a traceback; the stacks of
    # its threads as it died go to a file the parent puts in the failure (``_Rank.died``)
    crash = open(os.path.join(tmpdir, f"rank{rank}.crash"), "w")  # noqa: SIM115 (lives as long as we do)
    faulthandler.enable(file=crash, all_threads=True)
    # NOTE: our parent process is the fork server, which exits when the pool's process does
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(), tmpdir), daemon=True).start()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(tmpdir, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        dist.barrier()
    except BaseException:
        conn.send_bytes(pickle.dumps((READY, False, traceback.format_exc(), None)))
        return
    conn.send_bytes(pickle.dumps((READY, True, None, fingerprint())))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            _orphaned(tmpdir)
        if message is None:
            # NOTE: a normal interpreter exit with torch loaded costs ~0.5 s of CPU per rank; nothing a
            # worker holds needs cleaning up, so leave at once (stdio is flushed after every task).
            os._exit(0)
        task_id, target, kwargs = message
        conn.send_bytes(_run_task(task_id, target, kwargs))


def _run_task(task_id: int, target: str, kwargs: dict[str, Any]) -> bytes:
    """Run one task in a worker; the pickled reply is ``(task_id, ok, value or traceback, fingerprint)``."""
    try:
        module, _, qualname = target.partition(":")
        fn: Any = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        ok, value = True, fn(**kwargs)
    except BaseException:
        ok, value = False, traceback.format_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    state = fingerprint()
    if "torch._dynamo" in sys.modules:
        # NOTE: tasks must not see each other's compiled code or hit recompile limits from earlier tasks.
        sys.modules["torch._dynamo"].reset()
    try:
        return pickle.dumps((task_id, ok, value, state))
    except Exception:
        error = f"{target} returned an unpicklable value\n{traceback.format_exc()}"
        return pickle.dumps((task_id, False, error, state))


def fingerprint() -> Fingerprint:
    """This rank's process-group state: groups created so far and the collective count of each group."""
    try:
        from torch.distributed import distributed_c10d as c10d

        pgs = c10d._world.pg_map
        return c10d._world.group_count, {str(pg.group_name): int(pg._get_sequence_number_for_group()) for pg in pgs}
    except Exception:
        return None


def _exit_when_orphaned(parent_pid: int, tmpdir: str) -> None:
    """Worker watchdog thread: notices within a second that ``parent_pid`` is gone, even mid-task."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    _orphaned(tmpdir)


def _orphaned(tmpdir: str) -> NoReturn:
    """The parent died without closing the pool: remove the pool's files (no one else will) and exit."""
    shutil.rmtree(tmpdir, ignore_errors=True)
    os._exit(1)
