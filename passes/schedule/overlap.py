"""``overlap``: schedule each rank's program so its collectives run while it computes.

Every collective that moves data becomes a start and a ``comm.wait`` (``ir.asynchrony``), and so
does every ``mem.reload`` of an offloaded activation on a device with a copy engine (it runs on
the copy stream, beside the collectives' one); a list scheduler over the time model
(``timeline.Costs``, the one the sharding solve prices with) orders each phase, the forward's
ops first (``_sections``: an op that reads what the backward made is scheduled with the backward,
whatever its provenance says):

* a collective is started as soon as its operands exist, except one whose operands are all the
  phase's inputs (a parameter's FSDP gather: it could start at the very beginning), which starts
  ``prefetch`` segments before the segment of its first use (a segment: consecutive ops of one
  block, ``layers.3``, or of the code between blocks); the backward runs its blocks in reverse, so
  its prefetch looks the other way by itself;
* a ``comm.ppermute`` of what a collective brought (ring attention's keys passed on,
  ``passes/cp/steps.py``) starts once the op before that block's first reader has run: it travels
  while the reader computes, and a rank holds two blocks of the ring, not all of them;
* a reload (its operand, the host copy, the forward made) starts as late as lets its copy end
  before its first reader by the time model, the copy stream taking the reloads in the order of
  their readers, and no earlier than the reader of the reload before it: the copy is hidden under
  the compute between those readers where it fits, and at most one reader's reloads are held
  ahead of it;
* no start puts more than ``max-inflight`` bytes in flight on a rank (the operands and results of
  started, not yet waited collectives: a gradient's reduce-scatter holds the whole unreduced
  gradient; a started reload's device copy), unless nothing else is in flight; under a memory
  budget (``parallelize(memory=...)``) the bound is lowered until the predicted peak fits;
* a wait goes right before the first op that reads the collective's results; at each step the
  scheduler runs, among the ready ops within ``lookahead`` places of the earliest one that wait on
  no collective still on the wire, first one that a collective waits for (so the collective starts
  early and the independent work, such as a weight gradient's GEMM beside a tensor-parallel
  all-reduce, runs under it), else the earliest; when all would wait, the one whose collectives
  come off the wire first;
* a collective whose results leave the phase unread and that reads what another collective brought
  (a gradient's dp all-reduce after its tp one) starts once the compute stream has run the whole
  segment after the one that made that other's operands: the first travels under that segment's
  compute, and its wait does not stall the compute right after it;
* a collective whose results leave the phase unread (a gradient's reduce-scatter) is waited at the
  phase's end.

Before scheduling, ``tp-chunks`` splits GEMMs into column chunks (``chunks``) and ``nano-batches``
splits sequence-parallel regions into nano-batches of tokens (``nano``), so that the rules above
run one piece's collective under another piece's compute.

Ranks schedule the same graph with the same model, so every rank issues its collectives in the
same order. ``PassContext.stats["overlap"]`` holds the predicted communication, exposed time and
peak bytes in flight of the program before and after.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from meshfold.ir import Graph, GraphBuilder, Op, Phase, Value, is_view
from meshfold.ir.asynchrony import check_inflight, inflight
from meshfold.ir.ops import PPERMUTE, RELOAD, WAIT, draws
from meshfold.passes.base import Pass, PassError
from meshfold.passes.blocks import op_blocks
from meshfold.passes.cost.axis import axis_models
from meshfold.passes.cost.liveness import rank_memory, size_text
from meshfold.passes.schedule.chunks import chunk_matmuls
from meshfold.passes.schedule.nano import nano_batch
from meshfold.passes.schedule.timeline import Costs, replay
from meshfold.passes.schedule.windows import just_in_time, passed_on
from meshfold.passes.sharding.boxing import BOXED

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

SCHEDULED = "scheduled"
"""Collectives start early and wait late, a rank never holding more bytes in flight than the pass's
bound (``Overlap`` checks it as it ends)."""


@dataclass(frozen=True)
class Overlap(Pass):
    """Start collectives early and wait late
    (``overlap{prefetch=1,max-inflight=256MiB,lookahead=32,tp-chunks=1,nano-batches=1}``)."""

    name: ClassVar[str] = "overlap"
    requires: ClassVar[frozenset[str]] = frozenset({BOXED})
    ensures: ClassVar[frozenset[str]] = frozenset({SCHEDULED})
    invalidates: ClassVar[frozenset[str]] = frozenset()
    prefetch: int = 1
    max_inflight: int = 256 * 2**20
    lookahead: int = 32
    tp_chunks: int = 1
    """Split each GEMM whose partial result is all-reduced into this many column chunks, each chunk's
    all-reduce under the next chunk's GEMM (``chunks.chunk_matmuls``); 1: off."""
    nano_batches: int = 1
    """Split each sequence-parallel region (an all-gathered token tensor through GEMMs and pointwise
    ops to its reduce-scatter) into this many nano-batches of tokens, one's collectives under
    another's GEMMs (``nano.nano_batch``); 1: off."""

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        small = min(self.prefetch, self.lookahead) < 0 or min(self.tp_chunks, self.nano_batches) < 1
        if self.max_inflight <= 0 or small:
            raise PassError(
                f"{self}: max-inflight must be positive, prefetch and lookahead at least 0, tp-chunks and "
                "nano-batches at least 1"
            )
        if graph.mesh is None or any(op.target == WAIT for op in graph.ops):
            return graph
        costs = Costs(graph, axis_models(graph.mesh, ctx.options.cluster))  # NOTE: chunking keeps the mesh
        before = replay(graph, costs, events=False)
        graph = chunk_matmuls(nano_batch(graph, self.nano_batches), self.tp_chunks)
        if ctx.options.memory is None:
            out, cap = self._scheduled(graph, costs, self.max_inflight), self.max_inflight
        else:
            out, cap = self._within(ctx, graph, costs, ctx.options.memory)
        after = replay(out, costs, events=False)
        check_inflight(out, float(cap))  # NOTE: what ``scheduled`` promises, checked where it is made
        ctx.stats["overlap"] = {
            "comm_s": after.comm_total,
            "exposed_s": after.exposed_total,
            "exposed_before_s": before.exposed_total,
            "step_s": after.step,
            "step_before_s": before.step,
            "inflight_peak_bytes": inflight(out, nbytes=costs.nbytes).peak,
        }
        return out

    def _scheduled(self, graph: Graph, costs: Costs, cap: int) -> Graph:
        opts = replace(self, max_inflight=cap)
        b = GraphBuilder.like(graph)
        blocks = op_blocks(graph)
        sections = _sections(graph)
        for phase in ("fwd", "bwd"):
            idx = [k for k, section in enumerate(sections) if section == phase]
            _Scheduler(graph, costs, opts, [graph.ops[k] for k in idx], [blocks[k] for k in idx], b).run()
        for o in graph.outputs:
            b.add_output(o.kind, o.name, o.value)
        return b.build()

    def _within(self, ctx: PassContext, graph: Graph, costs: Costs, budget: int) -> tuple[Graph, int]:
        """Under a memory budget (``parallelize(memory=...)``): the schedule whose predicted peak
        (``passes.cost.liveness``) stays under it, with the bytes in flight capped first at the
        headroom the unscheduled program leaves, then halved; the program unscheduled (its
        collectives waited where issued) when no cap fits."""
        peak = rank_memory(graph, cluster=ctx.options.cluster).peak
        cap = max(min(self.max_inflight, budget - peak), 1)
        for _ in range(8):
            out = self._scheduled(graph, costs, cap)
            if rank_memory(out, cluster=ctx.options.cluster).peak <= budget:
                return out, cap
            cap = max(cap // 2, 1)
        if peak <= budget:
            ctx.warn(
                f"overlap: no schedule keeps the predicted peak under the memory budget ({size_text(budget)} per "
                "rank); collectives are waited where they are issued"
            )
        return graph, cap


def _sections(graph: Graph) -> list[Phase]:
    """The section of the schedule each op of ``graph`` goes in: ``bwd`` for a backward op and for an
    op that reads a value the backward section makes (an output's move, tagged ``fwd``, of a value a
    backward op computes), else ``fwd``.

    NOTE: the forward section is scheduled whole before the backward one, and a scheduler orders
    only its own section's ops after their producers (a value made elsewhere reads as made before
    it): so no op of the forward section may read a value of the backward one, or it is emitted
    before its producer. ``graph`` is in topological order: one walk puts every reader of the
    backward section's values in it."""
    late: set[Value] = set()
    out: list[Phase] = []
    for op in graph.ops:
        if op.prov.phase == "bwd" or not late.isdisjoint(op.operands):
            late.update(op.results)
            out.append("bwd")
        else:
            out.append("fwd")
    return out


class _Scheduler:
    """List scheduling of one phase's ops into ``b`` (see the module doc)."""

    def __init__(self, graph: Graph, costs: Costs, opts: Overlap, ops: list[Op], blocks: list[str], b: GraphBuilder):
        self.graph, self.costs, self.opts, self.ops, self.b = graph, costs, opts, ops, b
        self.comm = {k for k, op in enumerate(ops) if costs.moves_data(op)}
        made = {r: k for k, op in enumerate(ops) for r in op.results}
        self.deps = [sorted({made[v] for v in op.operands if v in made}) for op in ops]
        # NOTE: random ops draw from the program's one generator in program order (``backends/random.py``):
        # each waits for the one before it, or two independent dropouts (a parallel residual's) would swap
        # their masks
        drawn = [k for k, op in enumerate(ops) if draws(op)]
        for before, k in itertools.pairwise(drawn):
            if before not in self.deps[k]:
                self.deps[k] = sorted([*self.deps[k], before])
        self.users: dict[int, list[int]] = defaultdict(list)
        for k, ds in enumerate(self.deps):
            for d in ds:
                self.users[d].append(k)
        # NOTE: a windowed start waits until the compute stream has run an op at or after a place of
        # the phase (``opens``): for a collective, the first op of the segment ``prefetch`` segments
        # before its first reader's (segments: maximal runs of one block label among the computing
        # ops; a collective or reload between two ops of one block does not split it)
        seg, label, segment, first_op = -1, None, [], [-1]
        for k, blk in enumerate(blocks):
            if k not in self.comm and (seg < 0 or blk != label):
                seg, label = seg + 1, blk
                first_op.append(k)
            segment.append(max(seg, 0))
        self.opens: dict[int, int] = {}
        for c in self.comm:
            if not self.deps[c] and ops[c].target != RELOAD:
                first = min(self.users[c], default=c)
                self.opens[c] = first_op[max(segment[first] - opts.prefetch + 1, 0)]
        # NOTE: a collective the phase does not read, of what another brought (a gradient's dp all-reduce
        # after its tp one), opens once the compute stream has run the whole segment after the one
        # that made the other's operands: that one travels under a segment's compute, and its wait
        # does not stall the compute right after it (a view read by nothing else, that takes a result
        # to the outputs, is not a reader)
        unread = {c for c in self.comm if all(not self.users[u] and is_view(ops[u].target) for u in self.users[c])}
        for c in unread:
            brought = [d for d in self.deps[c] if d in self.comm]
            if not brought or ops[c].target in (PPERMUTE, RELOAD):
                continue
            source = max(max((segment[k] for k in self.deps[d]), default=segment[d]) for d in brought)
            after = source + 3  # NOTE: first_op[s + 1] is segment s's first op
            self.opens[c] = first_op[after] if after < len(first_op) else len(ops)
        passed_on(ops, self.comm, self.deps, self.users, self.opens)
        just_in_time(ops, self.comm, self.users, self.opens, costs)
        # NOTE: the collectives among each op's operands' producers: most ops read none, and only these
        # can hold an op back or need a wait before it
        self.wires = [[d for d in ds if d in self.comm] for ds in self.deps]
        # NOTE: a started collective holds its operands as well as its results until its wait (a
        # gradient's reduce-scatter keeps the whole unreduced gradient alive)
        # NOTE: a reload's operand is in the host tier: it holds only the device copy it makes
        held = {c: (*(() if ops[c].target == RELOAD else ops[c].operands), *ops[c].results) for c in self.comm}
        self.size = {c: sum(costs.nbytes(v) for v in vs) for c, vs in held.items()}
        # NOTE: the ops a computed collective that the phase reads waits for, from the last ``lookahead``
        # places before it: run first among the ready, so the collective starts early and independent
        # work goes under it (a gradient's reduce-scatter, read by no op, does not hurry its GEMM)
        self.feeds: set[int] = set()
        for c in self.comm:
            todo = list(self.deps[c]) if self.users[c] else []
            while todo:
                k = todo.pop()
                if k not in self.feeds and k not in self.comm and c - k <= opts.lookahead:
                    self.feeds.add(k)
                    todo.extend(self.deps[k])
        self.now = self.held = 0.0
        self.free = {"comm": 0.0, "copy": 0.0}  # NOTE: when each stream beside compute is next free
        self.reached = -1  # NOTE: the furthest place of the phase the compute stream has run
        self.ends: dict[int, float] = {}  # started collective -> when it finishes on the wire
        self.handles: dict[int, tuple[Value, ...]] = {}
        # NOTE: open issuable collectives by the bytes each holds (a few sizes), each sorted: hundreds wait at 80 layers
        self.issuable: dict[int, list[int]] = {}
        # NOTE: whether one may fit in flight since ``_issue`` last found that none does (a start only
        # adds bytes in flight: only a new issuable collective or a wait can make one fit)
        self.recheck = False

    def run(self) -> None:
        # NOTE: an op is ready once its compute operands are emitted and its collectives started (the
        # wait goes in when it is emitted); a collective is issuable on the same terms
        # NOTE: issuable collectives whose window has not opened wait in ``closed`` (a heap by the
        # place that opens them), so each step looks only at the open ones
        missing = {k: len(ds) for k, ds in enumerate(self.deps)}
        ready = [k for k, n in missing.items() if n == 0 and k not in self.comm]
        issuable = self.issuable
        closed: list[tuple[int, int]] = []

        def available(k: int) -> None:
            for u in self.users[k]:
                missing[u] -= 1
                if missing[u] == 0:
                    self._enqueue(u, ready, closed)

        for k, n in missing.items():
            if n == 0 and k in self.comm:
                self._enqueue(k, ready, closed)
        while True:
            while closed and closed[0][0] <= self.reached:
                self._issuable(heapq.heappop(closed)[1])
            started = self._issue()
            while started:  # NOTE: a collective of what one just started brought (a block passed on) starts too
                for c in started:
                    available(c)
                started = self._issue()
            if ready:
                k = self._pick(ready)
                del ready[bisect.bisect_left(ready, k)]
                self._emit(k)
                available(k)
            elif issuable or closed:  # NOTE: nothing runs until a held-back collective starts: make room, start it
                c = min([*(queue[0] for queue in issuable.values()), *(c for _, c in closed)])
                queue = issuable.get(self.size[c])
                if queue and queue[0] == c:  # NOTE: the earliest of them all heads its size's queue
                    self._take(c)
                else:
                    closed.remove((self.opens[c], c))
                    heapq.heapify(closed)
                while self.ends and self.held + self.size[c] > self.opts.max_inflight:
                    self._wait(min(self.ends, key=lambda d: (self.ends[d], d)))
                self._start(c)
                available(c)
            else:
                break
        for c in sorted(self.ends, key=lambda c: (self.ends[c], c)):  # NOTE: results that leave the phase
            self._wait(c)

    def _pick(self, ready: list[int]) -> int:
        """The earliest ready op that waits on nothing still on the wire, within ``lookahead`` places of
        the earliest ready one, one that feeds a collective first; else the one among those whose
        collectives come off the wire first (a nano-batch's gather, started before the reduce-scatter
        of the nano-batch before it), the earliest of equals. ``ready`` is sorted: it grows with depth
        (ops that read only the phase's inputs wait far ahead), and a pick looks only at its head."""
        near = ready[: bisect.bisect_right(ready, ready[0] + self.opts.lookahead)]
        free = None  # NOTE: the earliest that waits on nothing
        for k in near:
            urgent = k in self.feeds
            if (urgent or free is None) and not self._blocked(k):
                if urgent:
                    return k
                free = k
        if free is not None:
            return free
        return min(near, key=lambda k: (max(self.ends.get(d, 0.0) for d in self.wires[k]), k))

    def _blocked(self, k: int) -> bool:
        """Whether op ``k`` would wait on a collective still on the wire."""
        wires = self.wires[k]
        return bool(wires) and any(self.ends.get(d, 0.0) > self.now for d in wires)

    def _issue(self) -> list[int]:
        """Start, in the phase's order, every open issuable collective that fits in flight when its turn
        comes (a start may wait for what it reads, and so free bytes); the started."""
        out: list[int] = []
        if not self.recheck:
            return out
        self.recheck = False
        while (c := self._next(out[-1] if out else -1)) is not None:
            self._take(c)
            self._start(c)
            out.append(c)
        return out

    def _next(self, after: int) -> int | None:
        """The earliest issuable collective after place ``after`` that fits in flight (any, when none is
        in flight); None if none does."""
        fit = [q for size, q in self.issuable.items() if not self.ends or self.held + size <= self.opts.max_inflight]
        heads = [q[i] for q in fit if (i := bisect.bisect_right(q, after)) < len(q)]
        return min(heads, default=None)

    def _issuable(self, c: int) -> None:
        bisect.insort(self.issuable.setdefault(self.size[c], []), c)
        self.recheck = True

    def _take(self, c: int) -> None:
        queue = self.issuable[self.size[c]]
        del queue[bisect.bisect_left(queue, c)]
        if not queue:
            del self.issuable[self.size[c]]

    def _enqueue(self, k: int, ready: list[int], closed: list[tuple[int, int]]) -> None:
        """File op ``k``, whose operands now exist: ready to run, issuable, or issuable once its window opens."""
        if k not in self.comm:
            bisect.insort(ready, k)
        elif self.opens.get(k, -1) > self.reached:
            heapq.heappush(closed, (self.opens[k], k))
        else:
            self._issuable(k)

    def _start(self, c: int) -> None:
        self._waits_for(c)
        op = self.ops[c]
        handles = tuple(Value(f"{r.name}_start", r.type, r.layout) for r in op.results)
        start = Op(op.target, op.args, op.kwargs, handles, op.prov)
        self.costs.started(op, start)
        self.b.append(start)
        self.handles[c] = handles
        stream = self.costs.stream(op)
        begin = max(self.now, self.free[stream])
        self.free[stream] = self.ends[c] = begin + self.costs.comm(op)
        self.held += self.size[c]

    def _wait(self, c: int) -> None:
        op = self.ops[c]
        self.b.append(Op(WAIT, self.handles.pop(c), (), op.results, op.prov))
        self.now = max(self.now, self.ends.pop(c))
        self.held -= self.size[c]
        self.recheck = True

    def _waits_for(self, k: int) -> None:
        for d in self.wires[k]:
            if d in self.handles:
                self._wait(d)

    def _emit(self, k: int) -> None:
        self._waits_for(k)
        op = self.ops[k]
        self.b.append(op)
        if k > self.reached:
            self.reached = k
        self.now += self.costs.compute(op)
