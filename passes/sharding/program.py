"""The integer program of one mesh axis (see ``solve``'s module docstring for its variables).

Every price is the axis's time model (``passes.cost.axis.AxisModel``): an op's compute is the
roofline of its FLOPs and bytes on one device (divided over the ranks that share it), a move of a
value between placements the collective that makes it, on the group the axis's ranks form.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from meshfold.ir import Layout, Mesh, Op, Placement, Replicate, Shard, TensorType, Value
from meshfold.ir.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.ir.symbolic import divides
from meshfold.passes.base import PassError
from meshfold.passes.blocks import mirrored_blocks, mirrored_inputs, mirrored_ops
from meshfold.passes.sharding.batch import batch_values
from meshfold.passes.sharding.cost import nbytes
from meshfold.passes.sharding.opwork import op_bytes, op_flops
from meshfold.passes.sharding.problem import AxisStats, Problem
from meshfold.passes.sharding.strategy import Strategy

# NOTE: fp32 Adam keeps the parameter, its gradient and two moments: four copies of its bytes.
STATE_COPIES = 4.0


@dataclass(frozen=True)
class Ties:
    """Which ops and free inputs mirror an earlier block's (see ``passes.blocks``): they share the
    program's columns (``Problem.share_blocks``)."""

    ops: dict[int, int]
    inputs: dict[Value, Value]

    @staticmethod
    def of(problem: Problem) -> Ties:
        if not problem.share_blocks:
            return Ties({}, {})
        graph = problem.graph
        ops = {i: r for i, r in mirrored_ops(graph, _same_op).items() if problem.candidates[i] == problem.candidates[r]}
        blocks = mirrored_blocks(graph, _same_op)
        by_name = {i.name: i.value for i in graph.inputs}
        inputs = {
            by_name[n]: by_name[t]
            for n, t in mirrored_inputs(graph, blocks).items()
            if by_name[n] in problem.free and by_name[t] in problem.free and by_name[n].type == by_name[t].type
        }
        return Ties(ops, inputs)


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


@dataclass(frozen=True, slots=True)
class _Use:
    """``value`` is operand ``index`` of op ``op``; ``op`` -1: a graph output, ``want`` its layout
    or, for the gradient of a free parameter, that parameter (the gradient lands where it is)."""

    value: Value
    op: int
    index: int
    phase: str
    want: Placement | Value | None = None


class AxisProgram:
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
    ) -> None:
        graph, mesh = problem.graph, problem.mesh
        self.problem, self.graph, self.mesh, self.axis, self.per_op = problem, graph, mesh, axis, per_op
        self.k = mesh.names.index(axis)
        self.n = mesh.size(axis)
        self.model = problem.models[self.k]
        self.batch = batch_values(graph) if axis in problem.batch_axes else frozenset()
        """Values that may not leave a Shard for an op to read (``Problem.batch_axes``)."""
        # NOTE: also exempt: the experts op, whose all-gather dispatcher gathers the tokens over the
        # expert-parallel ranks by design (its result goes back to the batch split as P(sum))
        self.scalar_only = [
            op.target in (EXPERTS, EXPERTS_BACKWARD)
            or all(isinstance(r.type, TensorType) and r.type.rank == 0 for r in op.results)
            for op in graph.ops
        ]
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
            work = self._op_work(self.graph.ops[op_i], op_i)
            costs = [self._work(work, _splits(s)) + self._exchange_time(s) for s in ss]
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
        if v in self.batch:
            self._keep_split(v, uses, have, x)
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

    def _keep_split(
        self, v: Value, uses: list[_Use], have: dict[Placement, dict[int, float]], x: list[list[int]]
    ) -> None:
        """Forbid every op but a whole-batch reduction to a scalar to read the batch value ``v`` whole
        when it has a Shard: ``Y[v, p] + x[o, s] <= 1`` for each such strategy ``s``. Reading it as
        another Shard (an all-to-all: a concatenation along the batch dim, say) keeps the work split."""
        # NOTE: a graph output may still gather ``v``, and so may an op whose every result is a
        # scalar (the token count of a mean loss: an integer sum, which has no Partial form).
        for u in uses:
            if u.op < 0 or self.scalar_only[u.op]:
                continue
            for s, var in zip(self.per_op[u.op], x[u.op], strict=True):
                q = s.inputs[u.index]
                for p, t in have.items():
                    if isinstance(p, Shard) and not isinstance(q, Shard):
                        self.rows.append(({var: 1.0, **t}, -math.inf, 1.0 if t else 0.0))

    def _exchange_time(self, s: Strategy) -> float:
        """Time of the traffic an op makes itself under ``s`` (the all-to-all dispatcher): each rank
        sends its ``1/n`` share of ``s.exchange``."""
        if not s.exchange or self.n == 1:
            return 0.0
        return self.model.collective("all_to_all", s.exchange / self.n)

    def _move_time(self, p: Placement, q: Placement, size: float) -> float:
        """Time of turning ``p`` into ``q`` for a value of ``size`` bytes on this axis."""
        return self.model.redistribute(p, q, size)

    def _op_work(self, op: Op, op_i: int) -> tuple[float, float, int]:
        """The op's FLOPs and bytes, and how many ways the earlier axes' strategies divide them."""
        shrink = 1
        for a, s in enumerate(self.earlier[op_i]):
            if _splits(s):
                shrink *= self.mesh.sizes[a]
        return op_flops(op), op_bytes(op), shrink

    def _work(self, work: tuple[float, float, int], splits: bool) -> float:
        """Compute time of one rank's part of ``work`` (``_op_work``), this axis splitting it or not."""
        flops, nbytes_, shrink = work
        ways = shrink * (self.n if splits else 1)
        return self.model.compute(flops / ways, nbytes_ / ways)

    def _run(self) -> Any:
        nvar = len(self.cost)
        if nvar == 0:
            return np.zeros(0)  # NOTE: nothing to choose (no ops, nothing moves): HiGHS needs a column
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


def _splits(s: Strategy) -> bool:
    """Whether a strategy divides the op's work over the axis (some operand or result is a Shard)."""
    return any(isinstance(p, Shard) for p in (*s.inputs, *s.outputs))


def _ways(mesh: Mesh, placements: Sequence[Placement]) -> int:
    ways = 1
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            ways *= mesh.sizes[a]
    return ways
