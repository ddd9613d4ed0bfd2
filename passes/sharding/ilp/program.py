"""The integer program of one mesh axis (see ``solve``'s module docstring for its variables).

Every price is the axis's time model (``passes.cost.axis.AxisModel``): an op's compute is the
roofline of its FLOPs and bytes on one device (divided over the ranks that share it), a move of a
value between placements the collective that makes it, on the group the axis's ranks form.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from meshfold.ir import Layout, Mesh, Placement, Replicate, Shard, TensorType, Value
from meshfold.ir.memo import Kept, by_identity
from meshfold.ir.symbolic import divides
from meshfold.passes.base import PassError
from meshfold.passes.blocks import op_kinds
from meshfold.passes.sharding.cost import nbytes, own_traffic
from meshfold.passes.sharding.ilp.block_ties import Ties
from meshfold.passes.sharding.ilp.facts import graph_facts, op_reads
from meshfold.passes.sharding.ilp.milp import Columns
from meshfold.passes.sharding.ilp.moves import MoveColumns, Terms, Use
from meshfold.passes.sharding.ilp.problem import AxisStart, AxisStats, Problem
from meshfold.passes.sharding.opwork import op_bytes, op_flops
from meshfold.passes.sharding.strategy import Strategy

# NOTE: fp32 Adam keeps the parameter, its gradient and two moments: four copies of its bytes.
STATE_COPIES = 4.0


class AxisProgram(MoveColumns):
    """The program for one mesh axis; see the module docstring."""

    def __init__(
        self,
        problem: Problem,
        axis: str,
        per_op: list[list[Strategy]],
        earlier: list[list[Strategy]],
        placed: dict[Value, list[Placement]],
        budget: float | None,
        ties: Ties,
        work: dict[Hashable, tuple[float, float]],
    ) -> None:
        """``work``: each op's FLOPs and bytes by its key (``Problem.keys``), filled as needed and shared by the axes
        (a mirrored layer's ops cost the same)."""
        graph, mesh = problem.graph, problem.mesh
        self.problem, self.graph, self.mesh, self.axis, self.per_op = problem, graph, mesh, axis, per_op
        self.k = mesh.names.index(axis)
        self.n = mesh.size(axis)
        self.model = problem.models[self.k]
        facts = self.facts = graph_facts(graph)
        self.batch = facts.batch if axis in problem.batch_axes else frozenset()
        """Values that may not leave a Shard for an op to read (``Problem.batch_axes``)."""
        self.sequence = axis in problem.sequence_axes
        """Whether the axis splits the sequence (``Problem.sequence_axes``)."""
        self.scalar_only = facts.scalar_only
        self.budget = budget
        self.ties = ties
        self.work = work
        self._times: dict[tuple[tuple[float, float, int], bool], float] = {}
        self._split: Kept[Strategy, bool] = {}
        self.keys = problem.keys or op_kinds(graph)
        self.stats = AxisStats(axis, 0, 0, 0.0)
        self.m = Columns()
        self._read_terms: dict[tuple[int, int], tuple[Hashable, dict[Placement, Terms]]] = {}
        self._have_terms: dict[tuple[int, int], Hashable] = {}
        self._result_terms: dict[tuple[int, int], dict[Placement, Terms]] = {}
        # where each value comes from: (op index, result index), a fixed placement, or a choice
        self.source = facts.source
        self.fixed: dict[Value, Placement] = {}
        self.choice: dict[Value, dict[Placement, int]] = {}
        self.shrink: dict[Value, int] = {}
        """How many ways the earlier axes divide each value (absent: 1)."""
        self.travels = problem.travels
        ways: dict[tuple[int, ...], int] = {}  # NOTE: by the earlier strategies' identities and result
        for op_i, op in enumerate(graph.ops):
            before = earlier[op_i]
            if not before:
                continue
            for j, r in enumerate(op.results):
                key = (*map(id, before), j)
                w = ways.get(key)
                if w is None:
                    w = ways[key] = _ways(mesh, [e.outputs[j] for e in before])
                if w != 1:
                    self.shrink[r] = w
        for gi in graph.inputs:
            v = gi.value
            if v in problem.free:
                self.shrink[v] = _ways(mesh, placed[v])
                twin = ties.inputs.get(v)
                if twin in self.choice and list(self.choice[twin]) == _input_options(v, self.n, placed[v], mesh):
                    self.choice[v] = self.choice[twin]  # NOTE: a repeated block's parameter shares its layout
                    continue
                self.choice[v] = {}
                for p in _input_options(v, self.n, placed[v], mesh):
                    self.choice[v][p] = self.m.var(0.0, integer=True)
                self.m.rows.append(({x: 1.0 for x in self.choice[v].values()}, 1.0, 1.0))
                continue
            lay = problem.start.get(v, Layout.replicated(mesh))
            self.fixed[v] = lay.placement(axis)
            self.shrink[v] = _ways(mesh, [lay.placement(a) for a in mesh.names[: self.k]])
        self.earlier = earlier

    def solve(self, start: AxisStart | None = None) -> tuple[list[Strategy], dict[Value, Placement]]:
        """Build and solve; ``start``: a known plan of this axis to begin from (see ``AxisStart``)."""
        tied = {i: t for i, t in self.ties.ops.items() if _same(self.per_op[t], self.per_op[i])}
        x: list[list[int]] = [[] for _ in self.graph.ops]
        kept: dict[tuple[int, ...], tuple[float, float, int]] = {}
        works = [self._op_work(i, kept) for i in range(len(x))]
        priced: dict[int, list[float]] = {}  # NOTE: by list: ops sharing one (``solve``) cost the same
        copies: dict[tuple[int, int], int] = defaultdict(int)
        for op_i in sorted(range(len(x)), key=lambda i: i in tied):  # NOTE: columns first, then their users
            if id(ss := self.per_op[op_i]) not in priced:
                priced[id(ss)] = [self._time(works[op_i], s) for s in ss]
            if op_i in tied:
                x[op_i] = x[tied[op_i]]
                copies[tied[op_i], id(ss)] += 1  # NOTE: one column stands for the op in every repeated block
                continue
            x[op_i] = [self.m.var(c, integer=True) for c in priced[id(ss)]]
            self.m.rows.append(({v: 1.0 for v in x[op_i]}, 1.0, 1.0))
        for (op_i, costs), n in copies.items():
            for var, c in zip(x[op_i], priced[costs], strict=True):
                self.m.cost[var] += n * c
        shared = len(tied)
        shared_reads = op_reads(self.graph, tied)
        outs: dict[Value, dict[tuple[int, int, str], Use]] = defaultdict(dict)
        for out_i, o in enumerate(self.graph.outputs):
            want = self.problem.wants.get(out_i)
            if want is not None and isinstance(o.value.type, TensorType):
                phase = "bwd" if o.kind == "grad" else "fwd"
                placement = want.placement(self.axis) if isinstance(want, Layout) else want
                outs[o.value][-1, out_i, phase] = Use(o.value, -1, out_i, phase, placement)
        # NOTE: an op's read is kept as its index alone (a ``Use`` is made for values whose moves are
        # built, a few thousand of 60k at 80 layers); a graph output's as its ``Use``, after them
        reads: dict[Value, Mapping[tuple[int, int, str], int | Use]] = dict(shared_reads.by_value)
        for v, extra in outs.items():
            reads[v] = {**reads.get(v, {}), **extra}
        built: dict[Value, int] = {}
        for v, mine in reads.items():
            w = shared_reads.mirror.get(v)
            w = self._mirror(v, mine, reads, tied, w if w is not None and v not in outs and w not in outs else None)
            if w is not None and w in built:
                self.m.fold(built[w])  # NOTE: the same program as ``w``'s
                continue
            uses = [u if isinstance(u, Use) else Use(v, u, k, phase) for (_, k, phase), u in mine.items()]
            built[v] = self._moves(v, uses, x)
            if w is not None:  # NOTE: a value read only in the backward meets later layers' copies first
                built.setdefault(w, built[v])
        spills = self._memory(x) if self.budget is not None else []
        res = self._run(self._start_values(start, x) if start is not None else None)
        chosen: dict[int, int] = {}  # NOTE: by column list: ops of a repeated block share theirs
        for xs in x:
            if id(xs) not in chosen:
                chosen[id(xs)] = max(range(len(xs)), key=lambda i: (res[xs[i]], -i))
        picks = [ss[chosen[id(xs)]] for ss, xs in zip(self.per_op, x, strict=True)]
        inputs = {v: max(opts, key=lambda p: (res[opts[p]], -list(opts).index(p))) for v, opts in self.choice.items()}
        times: dict[tuple[int, int], float] = {}  # NOTE: by the identities of the work and the strategy
        compute = 0.0
        for work, s in zip(works, picks, strict=True):
            t = times.get((id(work), id(s)))
            if t is None:
                t = times[id(work), id(s)] = self._work(work, self._splits(s))
            compute += t
        a = self.answer
        self.stats = AxisStats(
            self.axis,
            sum(self.m.integer),
            shared,
            a.objective,
            compute,
            len(self.m.cost),
            len(self.m.rows),
            a.gap,
            a.optimal,
            a.nodes,
            self.m.folded,
            float(sum(res[var] * self.m.cost[var] for var in spills)),
        )
        return picks, inputs

    def _start_values(self, start: AxisStart, x: list[list[int]]) -> dict[int, float]:
        """The integral columns ``start`` sets: one strategy per op and one placement per free input,
        where they are among this program's choices (the first of ops sharing a column decides)."""
        vals: dict[int, float] = {}

        def put(columns: Sequence[int], pick: int) -> None:
            if not any(c in vals for c in columns):
                vals.update((c, 1.0 if j == pick else 0.0) for j, c in enumerate(columns))

        for i, s in enumerate(start.strategies):
            if s in self.per_op[i]:
                put(x[i], self.per_op[i].index(s))
        for v, opts in self.choice.items():
            p = start.inputs.get(v)
            if p in opts:
                put(list(opts.values()), list(opts).index(p))
        return vals

    def _memory(self, x: list[list[int]]) -> list[int]:
        """Parameter state (param, grad, Adam moments) plus activations the backward keeps, per device,
        at most the bound; with ``Problem.spill``, less what the memory pass frees at its price: one
        column per price stretch, at most its share of the activations. Returns those columns."""
        assert self.budget is not None
        row: dict[int, float] = defaultdict(float)
        acts: dict[int, float] = defaultdict(float)
        const = 0.0
        params = self.facts.params
        for v in self.facts.saved:  # NOTE: program order, so the row is the same every run
            if not isinstance(v.type, TensorType):
                continue
            state = STATE_COPIES * self.problem.states.get(v, 1.0) if v in params else 1.0
            size = nbytes(v.type) / self.shrink.get(v, 1) * state
            if v in params and v in self.fixed:
                const += size / (self.n if isinstance(self.fixed[v], Shard) else 1)
                continue
            if v in params or v in self.fixed:
                continue  # NOTE: inputs and tangents are the caller's; a param's bytes are counted above
            for p, t in self._placement_terms(v, x).items():
                for var, coef in t.items():
                    acts[var] += coef * size / (self.n if isinstance(p, Shard) else 1)
        for v, opts in self.choice.items():
            if v in params:
                assert isinstance(v.type, TensorType)
                size = nbytes(v.type) / self.shrink.get(v, 1) * STATE_COPIES * self.problem.states.get(v, 1.0)
                for p, var in opts.items():
                    row[var] += size / (self.n if isinstance(p, Shard) else 1)
        for var, coef in acts.items():
            row[var] += coef
        # NOTE: the row counts bytes per device times the later axes' ranks (``solve``); a step pays
        # for the bytes of one device
        later = math.prod(self.mesh.sizes[self.k + 1 :])
        spills = []
        for rate, share in self.problem.spill:
            s = self.m.var(rate / later, 0.0, math.inf)
            spills.append(s)
            row[s] = -1.0
            self.m.rows.append(({s: 1.0} | {var: -share * coef for var, coef in acts.items()}, -math.inf, 0.0))
        self.m.rows.append((dict(row), -math.inf, self.budget - const))
        return spills

    def _time(self, work: tuple[float, float, int], s: Strategy) -> float:
        """Time of one rank's part of ``work`` under ``s``: its compute and the traffic the op makes
        itself (``own_traffic``), of the part the earlier axes left it."""
        compute = self._work(work, _splits(s))
        return compute + own_traffic(self.model, s, work[2], compute)

    def _op_work(self, op_i: int, kept: dict[tuple[int, ...], tuple[float, float, int]]) -> tuple[float, float, int]:
        """The op's FLOPs and bytes, and how many ways the earlier axes' strategies divide them;
        ``kept``: the answers by op kind and the earlier strategies' identities (one tuple for the
        ops of every layer alike)."""
        ident = (self.keys[op_i], *map(id, self.earlier[op_i]))
        hit = kept.get(ident)
        if hit is not None:
            return hit
        shrink = 1
        for a, s in enumerate(self.earlier[op_i]):
            if self._splits(s):
                shrink *= self.mesh.sizes[a]
        key = self.keys[op_i]
        if key not in self.work:
            op = self.graph.ops[op_i]
            self.work[key] = (op_flops(op), op_bytes(op))
        hit = kept[ident] = (*self.work[key], shrink)
        return hit

    def _splits(self, s: Strategy) -> bool:
        """``_splits(s)``, kept (ops of one kind share their strategy objects)."""
        return by_identity(self._split, s, _splits)

    def _work(self, work: tuple[float, float, int], splits: bool) -> float:
        """Compute time of one rank's part of ``work`` (``_op_work``), this axis splitting it or not
        (kept: every layer of a stack asks the same)."""
        t = self._times.get((work, splits))
        if t is None:
            flops, nbytes_, shrink = work
            ways = shrink * (self.n if splits else 1)
            t = self._times[work, splits] = self.model.compute(flops / ways, nbytes_ / ways)
        return t

    def _run(self, start: dict[int, float] | None) -> Any:
        # NOTE: presolve pays where a plan fixes the inputs' layouts (a preset's program: 0.24 s with it,
        # 0.48 s without at 70B dims, dp axis); where they are free it removed little and was most of
        # the solve (0.97 s with it, 0.34 s without, same axis)
        presolve = not self.problem.free
        res = self.m.solve(gap=self.problem.gap, node_limit=self.problem.node_limit, start=start, presolve=presolve)
        self.answer = res
        if res.x is None:
            raise PassError(
                f"sharding solve on mesh axis {self.axis!r} failed: {res.message}"
                + ("; the memory bound may be too tight for this mesh" if self.budget is not None else "")
                + (
                    f"; the plan keeps the batch split on {self.axis!r}, and some op computed from the inputs "
                    "cannot run on a batch shard"
                    if self.batch
                    else ""
                )
            )
        return res.x


def _input_options(v: Value, n: int, earlier: list[Placement], mesh: Mesh) -> list[Placement]:
    """Replicate, or Shard(d) of every dim the axis divides (with earlier axes sharding it too)."""
    out: list[Placement] = [Replicate()]
    t = v.type
    if n == 1 or not isinstance(t, TensorType):
        return out
    for d, size in enumerate(t.shape):
        ways = n * math.prod(mesh.sizes[a] for a, p in enumerate(earlier) if isinstance(p, Shard) and p.dim == d)
        if divides(size, ways):
            out.append(Shard(d))
    return out


def _same(a: list[Strategy], b: list[Strategy]) -> bool:
    """Equal strategy lists (ops of one kind share the very list: ``solve``)."""
    return a is b or a == b


def _splits(s: Strategy) -> bool:
    """Whether a strategy divides the op's work over the axis (some operand or result is a Shard)."""
    return any(isinstance(p, Shard) for p in (*s.inputs, *s.outputs))


def _ways(mesh: Mesh, placements: Sequence[Placement]) -> int:
    ways = 1
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            ways *= mesh.sizes[a]
    return ways
