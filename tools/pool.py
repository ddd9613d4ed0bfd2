"""A pool of CPU/gloo ranks, spawned once and fed many tasks (docs/testing.md).

A task is a function named by import path (``"tests.dist.cases_smoke:rank_and_world"``) plus picklable
keyword arguments; code is never pickled. Every rank calls the function with the default (gloo) process
group initialised and returns a picklable value; ``RankPool.run`` returns those values in rank order::

    results = rank_pools.get(4).run("tests.dist.cases_smoke:functional_collectives", n=3)  # a list of 4

The tests share one pool per world size for their whole session (``tests/dist/conftest.py``);
``meshfold corpus`` runs its matrix on one. A task builds what it needs itself (``init_device_mesh``,
or ``pool_worker.device_mesh`` to reuse one) and must leave no collective half-issued; tasks share the
worker processes, so they must not rely on each other.

Each rank writes its stdout/stderr to a log file; after every task the parent prints what the ranks
wrote, prefixed ``[rank r]``, so pytest shows it with a failing test. Ranks are forked from a server
process (``forkserver``) that has torch and meshfold imported (and the ``preload`` modules). A script
(not pytest) that makes a pool needs the ``if __name__ == "__main__":`` guard: the server imports the
main module.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

from meshfold.tools.pool_worker import READY, WORKER_ENV, Fingerprint, worker_main

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess


DEFAULT_TIMEOUT_S = 300.0
SPAWN_TIMEOUT_S = 180.0
FAILURE_GRACE_S = 5.0
MAX_WORLD = 8

# NOTE: ranks are forked from one server process per pool-making process that has imported these
# already: a spawned rank spent about 6 s of CPU importing torch and meshfold (and 2-3 s more for
# transformers or Inductor where its tasks used them), and a session starts dozens of ranks
PRELOAD = ("torch", "torch.distributed", "meshfold.api", "transformers", "torch._inductor.compile_fx")


class RankFailure(RuntimeError):
    """A task failed on some ranks.

    ``failures`` maps each rank that raised (or died) to its formatted traceback; ``stuck`` maps each rank
    that never answered to a dump of its Python stacks. The message holds all of them, by rank.
    """

    def __init__(self, target: str, world: int, failures: dict[int, str], stuck: dict[int, str], note: str) -> None:
        self.target = target
        self.world = world
        self.failures = dict(sorted(failures.items()))
        self.stuck = dict(sorted(stuck.items()))
        lines = [f"{target} on {world} rank(s): {note}"]
        lines += [f"--- rank {rank} failed ---\n{text.rstrip()}" for rank, text in self.failures.items()]
        for rank, text in self.stuck.items():
            lines.append(f"--- rank {rank} did not finish; its stacks ---\n{text.rstrip()}")
        super().__init__("\n".join(lines))


class RankTimeout(RankFailure):
    """No rank raised, but some did not finish within the timeout (typically blocked in a collective)."""


@dataclass
class _Rank:
    """Parent-side handle of one worker process and its files in the pool's temporary directory."""

    rank: int
    process: BaseProcess
    conn: Connection
    tmpdir: Path
    log_offset: int = 0

    @property
    def stacks(self) -> Path:
        """Where the worker's faulthandler writes its stacks on SIGUSR1."""
        return self.tmpdir / f"rank{self.rank}.stacks"

    def died(self) -> str:
        """Why the worker's process ended: its exit code, and for a fatal signal (a crash in native
        code, such as a segmentation fault) the Python stacks faulthandler wrote as it died."""
        self.process.join(1.0)
        code = self.process.exitcode
        text = f"rank died (exit code {code})"
        if code is None or code >= 0:
            return text
        with contextlib.suppress(ValueError):
            text = f"rank died (exit code {code}, {signal.Signals(-code).name})"
        try:
            crash = (self.tmpdir / f"rank{self.rank}.crash").read_text(errors="replace").strip()
        except FileNotFoundError:
            return text
        return f"{text}\n{crash}" if crash else text

    def new_output(self) -> str:
        """What the worker wrote to stdout/stderr since the last call."""
        try:
            with (self.tmpdir / f"rank{self.rank}.log").open("rb") as f:
                f.seek(self.log_offset)
                data = f.read()
        except FileNotFoundError:
            return ""
        self.log_offset += len(data)
        return data.decode(errors="replace")


class RankPool:
    """``world`` gloo ranks on localhost in processes of their own, serving tasks until ``close``.

    Ranks are spawned at construction. A task that raises on some ranks leaves the pool usable when the
    ranks did alike to their process-group state during it (groups made, collectives issued); a hang,
    a dead rank or diverged state kills every rank, and the next ``run`` respawns them (``spawns``
    counts spawns, so tests can tell).
    """

    def __init__(
        self,
        world: int,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        spawn_timeout: float = SPAWN_TIMEOUT_S,
        failure_grace: float = FAILURE_GRACE_S,
        preload: tuple[str, ...] = PRELOAD,
    ) -> None:
        """``preload``: modules the fork server imports before it forks the ranks (the tasks' own,
        so that a respawn does not import them again)."""
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world must be in 1..{MAX_WORLD}, got {world}")
        self.world = world
        self.timeout = timeout
        self.spawn_timeout = spawn_timeout
        self.failure_grace = failure_grace
        self.preload = list(preload)
        self.spawns = 0
        self._task_id = 0
        # NOTE: the finalizer owns these two lists (mutated in place, never rebound) so that ranks are
        # killed and temporary files removed even when the pool is dropped without ``close``.
        self._ranks: list[_Rank] = []
        self._tmpdirs: list[Path] = []
        # NOTE: each rank's process-group state when it last finished a task the pool kept it after
        self._settled: dict[int, Fingerprint] = {}
        self._finalizer = weakref.finalize(self, _kill, self._ranks, self._tmpdirs)
        self._spawn()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, target: str, /, *, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``target`` (``"package.module:function"``) with ``kwargs`` on every rank; return values by rank.

        ``timeout`` (seconds, default ``self.timeout``) is the pool's own keyword and never reaches the task.
        Raises ``RankFailure`` when any rank raises or dies, ``RankTimeout`` when some rank does not finish.
        """
        module, sep, qualname = target.partition(":")
        if not (sep and module and qualname):
            raise ValueError(f"target must look like 'package.module:function', got {target!r}")
        if not self._finalizer.alive:
            raise RuntimeError("this RankPool is closed")
        task = pickle.dumps((self._task_id + 1, target, kwargs))
        if not self._ranks:
            self._spawn()
        self._task_id += 1
        try:
            return self._run(target, task, self.timeout if timeout is None else timeout)
        except RankFailure:
            raise
        except BaseException:
            # NOTE: unknown state (e.g. KeyboardInterrupt mid-task): never hand these ranks another task.
            self._teardown()
            raise

    def close(self) -> None:
        """Stop every rank (politely, then by force) and remove the pool's temporary files."""
        for r in self._ranks:
            with contextlib.suppress(OSError):
                r.conn.send_bytes(pickle.dumps(None))
        deadline = time.monotonic() + 5.0
        for r in self._ranks:
            r.process.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()

    def _run(self, target: str, task: bytes, timeout: float) -> list[Any]:
        """Send one pickled task to every rank and gather the replies (see ``run``)."""
        for r in self._ranks:
            with contextlib.suppress(OSError):  # a dead rank shows up in ``_gather``, as EOF on its pipe
                r.conn.send_bytes(task)
        results, failures, prints, pending, broken = self._gather(self._task_id, timeout, self.failure_grace)
        stuck = _dump_stacks(pending)
        self._relay_output()
        if not (stuck or broken or failures):
            self._settled = prints
            return [results[rank] for rank in range(self.world)]
        diverged = not (stuck or broken) and not _agree([_since(self._settled.get(r), p) for r, p in prints.items()])
        respawn = bool(stuck) or broken or diverged
        if respawn:
            self._teardown()
        else:
            self._settled = prints
        notes = [f"rank(s) {sorted(failures)} failed"] if failures else []
        if stuck:
            waited = f"{self.failure_grace}s after the first failure" if failures else f"within {timeout}s"
            notes.append(f"rank(s) {sorted(stuck)} did not finish {waited}")
        if diverged:
            notes.append("ranks disagree on process-group state (groups made or collectives issued)")
        if respawn:
            notes.append("ranks killed; the next task respawns them")
        raise (RankFailure if failures else RankTimeout)(target, self.world, failures, stuck, "; ".join(notes))

    def _gather(
        self, task_id: int, timeout: float, grace: float
    ) -> tuple[dict[int, Any], dict[int, str], dict[int, Fingerprint], list[_Rank], bool]:
        """Wait for each rank's reply to ``task_id``: values, failures, fingerprints, silent ranks, broken."""
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        prints: dict[int, Fingerprint] = {}
        pending: dict[Any, _Rank] = {r.conn: r for r in self._ranks}
        start, first_failure, broken = time.monotonic(), math.inf, False
        while pending:
            # NOTE: once a rank has failed, the others get only ``grace`` more: a rank blocked in a collective
            # that the failed rank never joined would otherwise hold the pool for the whole timeout.
            until = min(start + timeout, first_failure + grace)
            ready = wait(list(pending), timeout=max(0.0, until - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                r = pending.pop(conn)
                ok, payload, prints[r.rank], bad = _receive(r, task_id)
                broken = broken or bad
                if ok:
                    results[r.rank] = payload
                else:
                    failures[r.rank] = payload
                    first_failure = min(first_failure, time.monotonic())
        return results, failures, prints, list(pending.values()), broken

    def _spawn(self) -> None:
        """Start ``world`` workers on a fresh FileStore and wait until each has joined the process group."""
        tmp = Path(tempfile.mkdtemp(prefix=f"meshfold-rankpool-w{self.world}-"))
        self._tmpdirs.append(tmp)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(self.preload)
        # NOTE: the environment reaches the fork server, started by the first ``start``, and so every rank
        with mock.patch.dict(os.environ, WORKER_ENV):
            for rank in range(self.world):
                parent_conn, child_conn = ctx.Pipe()
                args = (rank, self.world, str(tmp), list(sys.path), child_conn)
                process = ctx.Process(target=worker_main, args=args, name=f"rankpool-w{self.world}-r{rank}")
                process.start()
                child_conn.close()
                self._ranks.append(_Rank(rank, process, parent_conn, tmp))
        self.spawns += 1
        _, failures, self._settled, pending, _ = self._gather(READY, self.spawn_timeout, grace=0.0)
        if failures or pending:
            stuck = _dump_stacks(pending)
            self._teardown()
            note = "ranks failed to start" if failures else f"ranks did not start within {self.spawn_timeout}s"
            raise RankFailure("<spawn>", self.world, failures, stuck, note)
        self._relay_output()

    def _teardown(self) -> None:
        """Kill every rank now; the next ``run`` respawns them."""
        self._relay_output()
        _kill(self._ranks, self._tmpdirs)

    def _relay_output(self) -> None:
        """Print what each rank wrote since the last relay, prefixed with its rank."""
        for r in self._ranks:
            text = r.new_output()
            if text:
                sys.stdout.write("".join(f"[rank {r.rank}] {line}\n" for line in text.splitlines()))
        sys.stdout.flush()


def _receive(r: _Rank, task_id: int) -> tuple[bool, Any, Fingerprint, bool]:
    """Read one reply: ``(ok, value or error text, fingerprint, whether the pool is now unusable)``."""
    try:
        reply = r.conn.recv_bytes()
    except (EOFError, OSError):
        return False, r.died(), None, True
    try:
        got_id, ok, payload, fingerprint = pickle.loads(reply)
    except Exception:
        return False, f"the parent could not unpickle the reply\n{traceback.format_exc()}", None, False
    # NOTE: ranks answer tasks in order and an unanswered task kills the pool: another id means a broken protocol.
    return ok, payload, fingerprint, got_id != task_id


def _since(before: Fingerprint, now: Fingerprint) -> Fingerprint:
    """What a rank did to its process-group state in one task: groups made and collectives issued per
    group since ``before`` (the state it settled in after its last task)."""
    if before is None or now is None:
        return None
    count, seqs = now
    return count - before[0], {name: seq - before[1].get(name, 0) for name, seq in seqs.items()}


def _agree(prints: list[Fingerprint]) -> bool:
    """Whether ranks did alike in a failed task, so another may follow: as many groups made, as many
    collectives issued in each group. Compared within the task, not since the start: a finished task
    may leave ranks' counts apart for good (a send and its receive count on their two ranks only)."""
    known = [p for p in prints if p is not None]
    if len(known) != len(prints):
        return False
    seen: dict[str, int] = {}
    for count, seqs in known:
        if count != known[0][0]:
            return False
        for name, seq in seqs.items():
            if seen.setdefault(name, seq) != seq:
                return False
    return True


def _dump_stacks(ranks: list[_Rank]) -> dict[int, str]:
    """Python stacks of every thread of each still-running rank (faulthandler, triggered by SIGUSR1)."""
    dumps = {r.rank: f"(not running; exit code {r.process.exitcode})" for r in ranks}
    alive = [r for r in ranks if r.process.is_alive() and r.process.pid and hasattr(signal, "SIGUSR1")]
    for r in alive:
        r.stacks.write_bytes(b"")
        os.kill(r.process.pid, signal.SIGUSR1)  # type: ignore[arg-type]
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + 3.0
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        now = {r.rank: r.stacks.stat().st_size for r in alive}
        if now == sizes and all(now.values()):
            break
        sizes = now
    for r in alive:
        dumps[r.rank] = r.stacks.read_text(errors="replace") or "(no stack dump arrived)"
    return dumps


def _kill(ranks: list[_Rank], tmpdirs: list[Path]) -> None:
    """Kill and reap every process in ``ranks``, close their pipes, delete ``tmpdirs``; empty both lists."""
    for r in ranks:
        if r.process.is_alive():
            r.process.kill()
    for r in ranks:
        r.process.join(5.0)
        r.conn.close()
    ranks.clear()
    for tmp in tmpdirs:
        shutil.rmtree(tmp, ignore_errors=True)
    tmpdirs.clear()
