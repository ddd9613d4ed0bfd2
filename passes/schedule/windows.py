"""Start windows of the overlap scheduler (``overlap._Scheduler``) tied to the compute stream: a ring's
``comm.ppermute`` (``passed_on``) and a reload from the host tier (``just_in_time``). Ops are places
of one phase; ``comm`` the collectives and reloads among them, ``deps``/``users`` the places each
reads from and is read by, ``opens`` the place the compute stream must reach before a start."""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict

from meshfold.ir import Op
from meshfold.ir.ops import PPERMUTE, RELOAD
from meshfold.passes.schedule.timeline import Costs


def passed_on(
    ops: list[Op], comm: set[int], deps: list[list[int]], users: defaultdict[int, list[int]], opens: dict[int, int]
) -> None:
    """Tie each ``comm.ppermute`` of a ring to the compute stream: one of what a collective brought
    (a block passed on round a ring) waits for the last computing op before that block's first
    reader here, so it travels while that reader computes, as a ring kernel passes it, and a
    rank holds the block it computes on and the one on its way, not every block of the ring;
    one of the phase's inputs only (the backward's move of saved values to the zigzag split)
    waits for the last computing op before its own first reader, where a kernel would move them,
    instead of a prefetch window that holds the copies through the layer's other work."""
    passed = [c for c in comm if ops[c].target == PPERMUTE]
    if not passed:
        return
    before, last = [], -1
    for k in range(len(ops)):
        before.append(last)
        if k not in comm:
            last = k
    for c in passed:
        brought = [d for d in deps[c] if d in comm]
        held = brought if brought else ([] if deps[c] else [c])
        readers = [u for d in held for u in users[d] if u not in comm]
        k = before[min(readers)] if readers else -1
        if 0 <= k < c and k not in deps[c]:  # NOTE: earlier in the phase's order: no cycle
            deps[c].append(k)
            users[k].append(c)
            opens.pop(c, None)


def just_in_time(
    ops: list[Op], comm: set[int], users: defaultdict[int, list[int]], opens: dict[int, int], costs: Costs
) -> None:
    """Open each reload's window as late as lets its copy end by its first reader's start, the copy
    stream taking the reloads one after another in the order of their readers (by the ops'
    predicted compute time in the phase's order), but not before the wait of the reload before
    it: one reader's reloads ahead at most, so where the copies outlast the compute (the copy
    engine is the bottleneck, and nothing hides them all) the device copies are not all held
    from the phase's start."""
    reloads = [c for c in comm if ops[c].target == RELOAD]
    if not reloads:
        return
    clock = list(itertools.accumulate((costs.compute(op) for op in ops), initial=0.0))
    first = {c: min(users[c], default=c) for c in reloads}
    readers = sorted(set(first.values()))
    before = dict(zip(readers[1:], readers, strict=False))  # NOTE: each reader -> the reader before it
    latest = math.inf
    for c in sorted(reloads, key=lambda c: first[c], reverse=True):
        latest = min(latest, clock[first[c]]) - costs.comm(ops[c])
        floor = before.get(first[c], 0) - 1  # NOTE: from the wait of the reload(s) before it
        # NOTE: issued before the op that runs at ``latest``: once the one before that has run
        opens[c] = max(min(bisect.bisect_right(clock, latest) - 2, first[c] - 1), floor)
