"""``sharding{mode=solve}``: choose every op's strategy by an integer program over the whole graph.

One mesh axis at a time (in mesh order, so an axis's choices see the shards the earlier axes put
on the same dims), a mixed-integer program picks one single-axis strategy per op:

* a binary ``x[o, s]`` per op ``o`` and valid strategy ``s`` with ``sum_s x[o, s] = 1``;
* a value's placement ``Y[u, p]`` is a sum of its producer's ``x`` (fixed for graph inputs, at the
  plan's compute placement);
* ``N[u, q, phase] >= sum of x[o, s]`` over consumers ``o`` in that phase whose strategy ``s`` needs
  ``u`` in ``q``: a value moved to a placement once per phase is shared by all its consumers
  there, as propagation shares the ``comm.redistribute``;
* ``W[u, p, q, phase] >= Y[u, p] + N[u, q, phase] - 1`` prices the move ``p -> q``.

The objective is time: per-op compute (a roofline of the op's FLOPs and bytes, divided over the
axis when the strategy shards anything) plus per-move collective time (latency + bytes on the
wire / bandwidth). The graph outputs are consumers too: the loss wants Replicate, each gradient
its parameter's storage layout. HiGHS (``scipy.optimize.milp``) solves it exactly.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from meshfold.ir import Graph, Layout, Mesh, Op, Placement, Replicate, Shard, TensorType, Value
from meshfold.passes.base import PassError, quiet
from meshfold.passes.blocks import mirrored_blocks, mirrored_inputs, mirrored_ops
from meshfold.passes.cost.hardware import Cluster
from meshfold.passes.sharding.cost import nbytes
from meshfold.passes.sharding.opwork import op_bytes, op_flops
from meshfold.passes.sharding.strategy import Strategy


@dataclass(frozen=True, slots=True)
class Machine:
    """What the solver's time model needs from the hardware: per-collective latency (s), link
    bandwidth (bytes/s), compute rate (FLOP/s) and memory bandwidth (bytes/s) of one device."""

    latency: float
    link_bw: float
    flops: float
    mem_bw: float

    def comm_time(self, wire_bytes: float) -> float:
        return self.latency + wire_bytes / self.link_bw

    def compute_time(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops, nbytes / self.mem_bw)


def machines_for(mesh: Mesh, cluster: Cluster | None, dtype: str = "fp32") -> tuple[Machine, ...]:
    """One time model per mesh axis. Without a cluster: gloo ranks on this CPU (``CPU_GLOO``). On a
    cluster, ranks fill nodes in mesh order with the LAST axis innermost, so an axis whose group
    (with every axis after it) fits in a node talks over the intra-node link, else between nodes."""
    if cluster is None:
        return tuple(CPU_GLOO for _ in mesh.names)
    dev, eff = cluster.device, cluster.device.eff
    flops = dev.peak_flops(dtype if dtype in dev.dtypes else "bf16") * eff.gemm_max
    out = []
    for k in range(len(mesh.names)):
        inner = math.prod(mesh.sizes[k:])
        if inner <= cluster.devices_per_node:
            latency, bw = cluster.intra.latency_s, cluster.intra.effective_bw
        else:
            latency, bw = cluster.inter.latency_s, cluster.inter_bw_per_device
        out.append(Machine(latency + eff.collective_base_s, bw, flops, dev.hbm_bw * eff.mem_max))
    return tuple(out)


# NOTE: measured on the 2-core CI machine: one gloo collective between 4 local ranks costs about
# 0.9 ms however small; one thread does ~10 GFLOP/s of fp32 matmul and streams ~4 GB/s.
CPU_GLOO = Machine(latency=9e-4, link_bw=1.0e9, flops=1.0e10, mem_bw=4.0e9)


@dataclass(frozen=True, slots=True)
class _Use:
    """``value`` is operand ``index`` of op ``op``; ``op`` -1: a graph output, ``want`` its layout
    or, for the gradient of a free parameter, that parameter (the gradient lands where it is)."""

    value: Value
    op: int
    index: int
    phase: str
    want: Placement | Value | None = None


@dataclass(frozen=True)
class Problem:
    """What the solver needs. ``start``: the layout fixed graph inputs are used in; ``free``: graph
    inputs whose layout the solver chooses (``plan="auto"``); ``wants[k]``: the layout graph output
    ``k`` must end in, or the free parameter whose layout its gradient must match; ``machines``:
    the time model of each mesh axis; ``memory``: per-device bytes for parameters with their
    gradient and Adam state plus saved activations (None: unbounded); ``valid(op, s, earlier)``:
    whether strategy ``s`` fits the op's shapes given the earlier axes' choices."""

    graph: Graph
    mesh: Mesh
    candidates: Sequence[list[Strategy]]
    start: dict[Value, Layout]
    free: frozenset[Value]
    wants: dict[int, Layout | Value]
    machines: tuple[Machine, ...]
    valid: Callable[[Op, Strategy, list[Strategy]], bool]
    memory: float | None = None
    time_limit: float = 30.0
    """Seconds HiGHS may spend per axis; past it the best solution found so far is used. The
    result may then depend on machine speed: compile on one rank and share the graph."""
    status: Callable[[str], AbstractContextManager[object]] = quiet
    """Shown while each axis is solved (see ``PassContext.status``)."""
    share_blocks: bool = True
    """Ops and parameters of repeated blocks (``layers.1`` ... mirroring ``layers.0``) share one set
    of strategy and layout variables: every layer of a stack gets the same plan, and the integer
    program has one layer's binaries instead of all of them."""


@dataclass(frozen=True)
class AxisStats:
    """What one axis's integer program was: its binaries, how many ops shared another op's, and the
    optimum it reached (seconds of modelled step time)."""

    axis: str
    binaries: int
    shared_ops: int
    objective: float


@dataclass(frozen=True)
class Solution:
    """One strategy per op and mesh axis, and the layout chosen for every free input."""

    strategies: list[list[Strategy]]
    inputs: dict[Value, Layout]
    stats: tuple[AxisStats, ...] = ()


# NOTE: fp32 Adam keeps the parameter, its gradient and two moments: four copies of its bytes.
STATE_COPIES = 4.0


def solve(problem: Problem) -> Solution:
    """Solve ``problem`` one mesh axis at a time (in mesh order)."""
    graph, mesh = problem.graph, problem.mesh
    chosen: list[list[Strategy]] = [[] for _ in graph.ops]
    placed: dict[Value, list[Placement]] = {v: [] for v in problem.free}
    ties = _Ties.of(problem)
    stats: list[AxisStats] = []
    for k, axis in enumerate(mesh.names):
        per_op = []
        for i, op in enumerate(graph.ops):
            ok = [s for s in problem.candidates[i] if problem.valid(op, s, chosen[i])]
            if not ok:
                raise PassError(f"{op.describe()}: no valid sharding strategy on mesh axis {axis!r}")
            per_op.append(ok)
        later = math.prod(mesh.sizes[k + 1 :])
        budget = None if problem.memory is None else problem.memory * later
        program = _Axis(problem, axis, per_op, chosen, placed, budget, ties)
        with problem.status(f"sharding solve: mesh axis {axis!r}, {len(graph.ops)} ops (≤ {problem.time_limit:g} s)"):
            picks, inputs = program.solve()
        stats.append(program.stats)
        for i, s in enumerate(picks):
            chosen[i].append(s)
        for v, p in inputs.items():
            placed[v].append(p)
    layouts = {v: Layout(mesh.names, tuple(ps)) for v, ps in placed.items()}
    return Solution(chosen, layouts, tuple(stats))


@dataclass(frozen=True)
class _Ties:
    """Which ops and free inputs mirror an earlier block's (see ``passes.blocks``)."""

    ops: dict[int, int]
    inputs: dict[Value, Value]

    @staticmethod
    def of(problem: Problem) -> _Ties:
        if not problem.share_blocks:
            return _Ties({}, {})
        graph = problem.graph
        ops = {i: r for i, r in mirrored_ops(graph, _same_op).items() if problem.candidates[i] == problem.candidates[r]}
        blocks = mirrored_blocks(graph, _same_op)
        by_name = {i.name: i.value for i in graph.inputs}
        inputs = {
            by_name[n]: by_name[t]
            for n, t in mirrored_inputs(graph, blocks).items()
            if by_name[n] in problem.free and by_name[t] in problem.free and by_name[n].type == by_name[t].type
        }
        return _Ties(ops, inputs)


def _same_op(a: Op, b: Op) -> bool:
    """Same target, same operand and result types, same non-tensor arguments."""
    return (
        a.target == b.target
        and [v.type for v in a.operands] == [v.type for v in b.operands]
        and [v.type for v in a.results] == [v.type for v in b.results]
        and _consts(a) == _consts(b)
    )


def _consts(op: Op) -> tuple[object, ...]:
    return tuple(a for a in (*op.args, *(v for _, v in op.kwargs)) if not isinstance(a, Value))


class _Axis:
    """The program for one mesh axis; see the module docstring."""

    def __init__(
        self,
        problem: Problem,
        axis: str,
        per_op: list[list[Strategy]],
        earlier: list[list[Strategy]],
        placed: dict[Value, list[Placement]],
        budget: float | None,
        ties: _Ties,
    ) -> None:
        graph, mesh = problem.graph, problem.mesh
        self.problem, self.graph, self.mesh, self.axis, self.per_op = problem, graph, mesh, axis, per_op
        self.k = mesh.names.index(axis)
        self.n = mesh.size(axis)
        self.machine = problem.machines[self.k]
        self.budget = budget
        self.ties = ties
        self.stats = AxisStats(axis, 0, 0, 0.0)
        self.cost: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        # where each value comes from: (op index, result index), a fixed placement, or a choice
        self.source: dict[Value, tuple[int, int]] = {}
        self.fixed: dict[Value, Placement] = {}
        self.choice: dict[Value, dict[Placement, int]] = {}
        self.shrink: dict[Value, int] = {}
        for op_i, op in enumerate(graph.ops):
            for j, r in enumerate(op.results):
                self.source[r] = (op_i, j)
                self.shrink[r] = _ways(mesh, [(e.outputs[j]) for e in earlier[op_i]])
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
                    self.choice[v][p] = self._var(0.0, integer=True)
                self.rows.append(({x: 1.0 for x in self.choice[v].values()}, 1.0, 1.0))
                continue
            lay = problem.start.get(v, Layout.replicated(mesh))
            self.fixed[v] = lay.placement(axis)
            self.shrink[v] = _ways(mesh, [lay.placement(a) for a in mesh.names[: self.k]])
        self.earlier = earlier

    def _var(self, cost: float, lo: float = 0.0, hi: float = 1.0, integer: bool = False) -> int:
        self.cost.append(cost)
        self.lo.append(lo)
        self.hi.append(hi)
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def solve(self) -> tuple[list[Strategy], dict[Value, Placement]]:
        tied = {i: t for i, t in self.ties.ops.items() if self.per_op[t] == self.per_op[i]}
        x: list[list[int]] = [[] for _ in self.graph.ops]
        for op_i in sorted(range(len(x)), key=lambda i: i in tied):  # NOTE: columns first, then their users
            ss = self.per_op[op_i]
            work = self._work(self.graph.ops[op_i], op_i)
            costs = [(work / self.n if _splits(s) else work) + self._exchange_time(s) for s in ss]
            if op_i in tied:
                x[op_i] = x[tied[op_i]]
                for var, c in zip(x[op_i], costs, strict=True):
                    self.cost[var] += c  # NOTE: one column stands for the op in every repeated block
                continue
            x[op_i] = [self._var(c, integer=True) for c in costs]
            self.rows.append(({v: 1.0 for v in x[op_i]}, 1.0, 1.0))
        shared = len(tied)
        uses: dict[Value, list[_Use]] = defaultdict(list)
        for op_i, op in enumerate(self.graph.ops):
            for k, v in enumerate(op.operands):
                if isinstance(v.type, TensorType):
                    uses[v].append(_Use(v, op_i, k, op.prov.phase))
        for out_i, o in enumerate(self.graph.outputs):
            want = self.problem.wants.get(out_i)
            if want is not None and isinstance(o.value.type, TensorType):
                phase = "bwd" if o.kind == "grad" else "fwd"
                placement = want.placement(self.axis) if isinstance(want, Layout) else want
                uses[o.value].append(_Use(o.value, -1, out_i, phase, placement))
        for v, us in uses.items():
            self._moves(v, us, x)
        if self.budget is not None:
            self._memory(x)
        res = self._run()
        self.stats = AxisStats(self.axis, sum(self.integer), shared, float(np.dot(self.cost, res)))
        picks = []
        for ss, vars_ in zip(self.per_op, x, strict=True):
            best = max(range(len(vars_)), key=lambda i: (res[vars_[i]], -i))
            picks.append(ss[best])
        inputs = {v: max(opts, key=lambda p: (res[opts[p]], -list(opts).index(p))) for v, opts in self.choice.items()}
        return picks, inputs

    def _memory(self, x: list[list[int]]) -> None:
        """Parameter state (param, grad, Adam moments) plus activations the backward keeps, per device."""
        assert self.budget is not None
        row: dict[int, float] = defaultdict(float)
        const = 0.0
        fwd = {r for op in self.graph.ops if op.prov.phase == "fwd" for r in op.results}
        saved = {v for op in self.graph.ops if op.prov.phase == "bwd" for v in op.operands if v in fwd}
        params = {i.value for i in self.graph.inputs if i.kind in ("param", "buffer")}
        for v in saved | params:
            if not isinstance(v.type, TensorType):
                continue
            size = nbytes(v.type) / self.shrink.get(v, 1) * (STATE_COPIES if v in params else 1.0)
            if v in params and v in self.fixed:
                const += size / (self.n if isinstance(self.fixed[v], Shard) else 1)
                continue
            if v in params or v in self.fixed:
                continue  # NOTE: inputs and tangents are the caller's; a param's bytes are counted above
            for p, t in self._placement_terms(v, x).items():
                for var, coef in t.items():
                    row[var] += coef * size / (self.n if isinstance(p, Shard) else 1)
        for v, opts in self.choice.items():
            if v in params:
                assert isinstance(v.type, TensorType)
                size = nbytes(v.type) / self.shrink.get(v, 1) * STATE_COPIES
                for p, var in opts.items():
                    row[var] += size / (self.n if isinstance(p, Shard) else 1)
        self.rows.append((dict(row), -math.inf, self.budget - const))

    def _placement_terms(self, v: Value, x: list[list[int]]) -> dict[Placement, dict[int, float]]:
        """``Y[v, p]`` as linear terms over ``x`` (an empty dict: the constant 1)."""
        if v in self.fixed:
            return {self.fixed[v]: {}}
        if v in self.choice:
            return {p: {var: 1.0} for p, var in self.choice[v].items()}
        op_i, j = self.source[v]
        out: dict[Placement, dict[int, float]] = defaultdict(dict)
        for s, var in zip(self.per_op[op_i], x[op_i], strict=True):
            out[s.outputs[j]][var] = 1.0
        return out

    def _moves(self, v: Value, uses: list[_Use], x: list[list[int]]) -> None:
        assert isinstance(v.type, TensorType)
        size = nbytes(v.type) / self.shrink.get(v, 1)
        have = self._placement_terms(v, x)
        need: dict[tuple[Placement, str], list[dict[int, float]]] = defaultdict(list)
        for u in uses:
            if u.op < 0:
                if isinstance(u.want, Value):  # the gradient of a free parameter: wherever it lives
                    for q, var in self.choice[u.want].items():
                        need[(q, u.phase)].append({var: 1.0})
                elif u.want is not None:
                    need[(u.want, u.phase)].append({})
                continue
            terms: dict[Placement, dict[int, float]] = defaultdict(dict)
            for s, var in zip(self.per_op[u.op], x[u.op], strict=True):
                terms[s.inputs[u.index]][var] = 1.0
            for q, t in terms.items():
                need[(q, u.phase)].append(t)
        for (q, _phase), demands in need.items():
            if all(p == q for p in have):
                continue
            forced = any(not t for t in demands)
            if not forced and len(have) == 1:
                # NOTE: one source placement p != q: the move is paid iff some consumer asks for q
                (p,) = have
                c = self._move_time(p, q, size)
                nvar = self._var(c)
                for t in demands:  # N >= demand
                    self.rows.append(({nvar: 1.0, **{k: -c for k, c in t.items()}}, 0.0, math.inf))
                continue
            # M[p] <= Y[p]; sum_p M[p] >= N (the need for q is met from the placements u may have)
            ms: dict[int, float] = {}
            for p, t in have.items():
                m = self._var(self._move_time(p, q, size) if p != q else 0.0)
                ms[m] = 1.0
                if t:
                    self.rows.append(({m: 1.0, **{k: -c for k, c in t.items()}}, -math.inf, 0.0))
            if forced:
                self.rows.append((ms, 1.0, math.inf))
            else:
                for t in demands:
                    row = dict(ms)
                    for k, c in t.items():
                        row[k] = row.get(k, 0.0) - c
                    self.rows.append((row, 0.0, math.inf))

    def _exchange_time(self, s: Strategy) -> float:
        """Time of the traffic an op makes itself under ``s`` (the all-to-all dispatcher)."""
        if not s.exchange or self.n == 1:
            return 0.0
        return self.machine.comm_time(s.exchange / self.n * (self.n - 1) / self.n)

    def _move_time(self, p: Placement, q: Placement, size: float) -> float:
        n = self.n
        if n == 1 or p == q:
            return 0.0
        frac = (n - 1) / n
        if isinstance(p, Replicate):
            return 1e-9  # a local slice (or keeping a Partial on one rank): no wire, a copy at most
        if isinstance(p, Shard):
            wire = size * frac if not isinstance(q, Shard) else size * frac / n
        else:
            wire = 2 * size * frac if not isinstance(q, Shard) else size * frac
        return self.machine.comm_time(wire)

    def _work(self, op: Op, op_i: int) -> float:
        shrink = 1
        for a, s in enumerate(self.earlier[op_i]):
            if _splits(s):
                shrink *= self.mesh.sizes[a]
        return self.machine.compute_time(op_flops(op), op_bytes(op)) / shrink

    def _run(self) -> Any:
        nvar = len(self.cost)
        r_idx, c_idx, vals, lo, hi = [], [], [], [], []
        for r, (row, lb, ub) in enumerate(self.rows):
            for c, v in row.items():
                r_idx.append(r)
                c_idx.append(c)
                vals.append(v)
            lo.append(lb)
            hi.append(ub)
        a = coo_array((vals, (r_idx, c_idx)), shape=(len(self.rows), nvar)).tocsr()
        res = milp(
            c=np.asarray(self.cost),
            constraints=LinearConstraint(a, np.asarray(lo), np.asarray(hi)),
            integrality=np.asarray(self.integer),
            bounds=Bounds(np.asarray(self.lo), np.asarray(self.hi)),
            options={"disp": False, "mip_rel_gap": 1e-4, "time_limit": self.problem.time_limit},
        )
        if res.x is None:
            raise PassError(
                f"sharding solve on mesh axis {self.axis!r} failed: {res.message}"
                + ("; the memory bound may be too tight for this mesh" if self.budget is not None else "")
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
        if isinstance(size, int) and size % ways == 0 and size >= ways:
            out.append(Shard(d))
    return out


def _splits(s: Strategy) -> bool:
    """Whether a strategy divides the op's work over the axis (some operand or result is a Shard)."""
    return any(isinstance(p, Shard) for p in (*s.inputs, *s.outputs))


def _ways(mesh: Mesh, placements: Sequence[Placement]) -> int:
    ways = 1
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            ways *= mesh.sizes[a]
    return ways
