"""The columns and rows of one mesh axis's program that price moving values between placements
(``AxisProgram`` builds the rest: one column per op strategy, the memory row, the solve)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Mapping
from typing import NamedTuple

from meshfold.ir import Graph, Op, Placement, Shard, TensorType, Value
from meshfold.passes.cost.axis import AxisModel
from meshfold.passes.sharding.cost import nbytes
from meshfold.passes.sharding.ilp.block_ties import Ties
from meshfold.passes.sharding.ilp.milp import Columns
from meshfold.passes.sharding.rules.attention import OPERAND_ROLES, RESULT_ROLES
from meshfold.passes.sharding.rules.operands import operand_names
from meshfold.passes.sharding.strategy import Strategy

Terms = dict[int, float]
"""A linear expression over the program's columns (empty: the constant 1)."""
Demands = list[tuple[str, dict[Placement, Terms]]]
"""Per consumer of a value: its phase, and for each placement it may read the value in, the terms
that are 1 when it does."""


class Use(NamedTuple):
    """``value`` is operand ``operand`` of op ``op``; ``op`` -1: graph output ``operand``, ``want``
    its layout or, for the gradient of a free parameter, that parameter (the gradient lands where
    it is). A tuple: a program makes one per value read per op (80k at 80 layers)."""

    value: Value
    op: int
    operand: int
    phase: str
    want: Placement | Value | None = None


class MoveColumns:
    """What an axis program knows of its values (set by ``AxisProgram``), and the move pricing."""

    graph: Graph
    per_op: list[list[Strategy]]
    model: AxisModel
    m: Columns
    source: dict[Value, tuple[int, int]]
    fixed: dict[Value, Placement]
    choice: dict[Value, dict[Placement, int]]
    shrink: dict[Value, int]
    travels: Mapping[Value, float]
    batch: frozenset[Value]
    sequence: bool
    scalar_only: list[bool]
    ties: Ties
    _read_terms: dict[tuple[int, int], tuple[Hashable, dict[Placement, Terms]]]
    _have_terms: dict[tuple[int, int], Hashable]
    _result_terms: dict[tuple[int, int], dict[Placement, Terms]]

    def _placement_terms(self, v: Value, x: list[list[int]]) -> dict[Placement, dict[int, float]]:
        """``Y[v, p]`` as linear terms over ``x`` (an empty dict: the constant 1); not to be changed
        (an op result's are kept by its producer's columns)."""
        if v in self.fixed:
            return {self.fixed[v]: {}}
        if v in self.choice:
            return {p: {var: 1.0} for p, var in self.choice[v].items()}
        op_i, j = self.source[v]
        key = (id(x[op_i]), j)  # NOTE: the same for every op sharing the columns (a mirrored layer's)
        out = self._result_terms.get(key)
        if out is None:
            out = self._result_terms[key] = defaultdict(dict)
            for s, var in zip(self.per_op[op_i], x[op_i], strict=True):
                out[s.outputs[j]][var] = 1.0
        return out

    def _mirror(
        self,
        v: Value,
        mine: Mapping[tuple[int, int, str], int | Use],
        reads: Mapping[Value, Mapping[tuple[int, int, str], int | Use]],
        tied: dict[int, int],
        known: Value | None = None,
    ) -> Value | None:
        """The value of a repeated block's first copy whose moves are ``v``'s (see ``_moves``), or None.

        ``mine``: ``v``'s reads, each op's under (the op it is tied to, operand index, phase), each
        graph output's ``Use`` under (-1, output index, phase); ``reads``: every value's; ``known``:
        that value where the caller found it has reads of the same keys, no graph output among
        them (``facts.OpReads.mirror``), so only the sizes and batch rules are left to compare.

        ``v`` made by an op tied to another (so it has that op's columns), or a parameter sharing its
        twin's layout columns, has the same placement terms as the same result of that op (the
        twin); if its reads are that value's, in order (the same keys; a graph output wanting the
        same placement, or the layout of parameters that share columns), its demands and so its
        whole key are equal too, and building it again would only fold. A different size or batch
        rule keeps it apart."""
        if known is not None:
            return known if self._alike(v, known) else None
        w = self._counterpart(v, tied)
        theirs = None if w is None else reads.get(w)
        if w is None or theirs is None or len(theirs) != len(mine):
            return None
        if not self._alike(v, w):
            return None
        for (ka, a), (kb, b) in zip(mine.items(), theirs.items(), strict=True):
            if ka == kb:
                continue
            if ka[0] >= 0 or kb[0] >= 0 or ka[2] != kb[2]:
                return None
            assert isinstance(a, Use) and isinstance(b, Use)
            if not self._same_want(a.want, b.want):
                return None
        return w

    def _alike(self, v: Value, w: Value) -> bool:
        """Whether ``v`` and ``w`` are divided alike by the earlier axes and kept alike to the batch split."""
        return self.shrink.get(v, 1) == self.shrink.get(w, 1) and (v in self.batch) == (w in self.batch)

    def _counterpart(self, v: Value, tied: dict[int, int]) -> Value | None:
        """The same result of the op ``v``'s producer is tied to, or the parameter whose layout
        columns ``v`` shares."""
        src = self.source.get(v)
        if src is not None:
            return self.graph.ops[tied[src[0]]].results[src[1]] if src[0] in tied else None
        twin = self.ties.inputs.get(v)
        if twin is None or v not in self.choice or self.choice.get(twin) is not self.choice[v]:
            return None
        return twin

    def _same_want(self, a: Placement | Value | None, b: Placement | Value | None) -> bool:
        if isinstance(a, Value) and isinstance(b, Value):
            return self.choice[a] is self.choice[b]
        return not isinstance(a, Value) and not isinstance(b, Value) and a == b

    def _moves(self, v: Value, uses: list[Use], x: list[list[int]]) -> int:
        """Columns and rows pricing every move of ``v`` its consumers ask for; returns the number of
        the build they are (or folded into)."""
        assert isinstance(v.type, TensorType)
        size = nbytes(v.type) * self.travels.get(v, 1.0) / self.shrink.get(v, 1)
        have = self._placement_terms(v, x)
        if v in self.batch:
            self._keep_split(v, uses, have, x)
        # NOTE: consumers in mirrored blocks read a value shared by every layer (a view of the rotary
        # tables) through the same columns: one demand stands for them all
        unique: dict[Hashable, tuple[str, dict[Placement, Terms]]] = {}
        for u in uses:
            if u.op < 0:
                if isinstance(u.want, Value):  # the gradient of a free parameter: wherever it lives
                    d = {q: {var: 1.0} for q, var in self.choice[u.want].items()}
                elif u.want is not None:
                    d = {u.want: {}}
                else:
                    continue
                unique.setdefault((u.phase, _frozen(d)), (u.phase, d))
                continue
            frozen, d = self._reads(u.op, u.operand, x)
            unique.setdefault((u.phase, frozen), (u.phase, d))
        key = (size, self._frozen_have(v, have, x), tuple(unique))
        demands = list(unique.values())
        if len(have) == 1:
            return self.m.once(key, lambda: self._moves_from((*have,)[0], size, demands))
        return self.m.once(key, lambda: self._flows(have, size, demands))

    def _reads(self, op_i: int, index: int, x: list[list[int]]) -> tuple[Hashable, dict[Placement, Terms]]:
        """``Z[op, index, q]``: the terms that are 1 when the op reads operand ``index`` in ``q``, and
        their frozen form; the same for every op sharing the columns (kept by the columns' list)."""
        key = (id(x[op_i]), index)
        hit = self._read_terms.get(key)
        if hit is None:
            terms: dict[Placement, Terms] = defaultdict(dict)
            for s, var in zip(self.per_op[op_i], x[op_i], strict=True):
                terms[s.inputs[index]][var] = 1.0
            hit = self._read_terms[key] = (_frozen(terms), terms)
        return hit

    def _frozen_have(self, v: Value, have: dict[Placement, Terms], x: list[list[int]]) -> Hashable:
        """``_frozen(have)``, kept by the producer's columns (the same for its every mirror)."""
        src = self.source.get(v)
        if src is None:
            return _frozen(have)
        key = (id(x[src[0]]), -1 - src[1])
        hit = self._have_terms.get(key)
        if hit is None:
            hit = self._have_terms[key] = _frozen(have)
        return hit

    def _moves_from(
        self, p: Placement, size: float, demands: list[tuple[str, dict[Placement, dict[int, float]]]]
    ) -> None:
        """One source placement ``p``: the move to ``q`` is paid once per phase iff some consumer
        there asks for ``q`` (``N >= Z_u[q]``; exact)."""
        need: dict[tuple[Placement, str], list[dict[int, float]]] = defaultdict(list)
        for phase, d in demands:
            for q, t in d.items():
                if q != p:
                    need[(q, phase)].append(t)
        for (q, _phase), ts in need.items():
            c = self._move_time(p, q, size)
            forced = any(not t for t in ts)
            nvar = self.m.var(c, lo=1.0 if forced else 0.0)
            for t in ts:
                if t:
                    self.m.rows.append(({nvar: 1.0, **{k: -w for k, w in t.items()}}, 0.0, math.inf))

    def _flows(
        self,
        have: dict[Placement, dict[int, float]],
        size: float,
        demands: Demands,
    ) -> None:
        """Several source placements: per consumer ``u``, a flow ``f_u[p, q] >= 0`` whose sums over
        ``q`` are the value's placement ``Y[p]`` and over ``p`` the placement ``u`` reads ``Z_u[q]``
        (the edge's joint choice, exact where the graph is a tree and tight elsewhere); the move
        ``p -> q`` of a phase is paid once, ``M[p, q] >= f_u[p, q]`` for its every consumer."""
        paid: dict[tuple[Placement, Placement, str], list[int]] = defaultdict(list)
        for phase, d in demands:
            f = {(p, q): self.m.var(0.0, hi=math.inf) for p in have for q in d}
            for p, t in have.items():
                row = {f[p, q]: 1.0 for q in d}
                for k, w in t.items():
                    row[k] = row.get(k, 0.0) - w
                self.m.rows.append((row, 0.0, 0.0))
            for q, t in d.items():
                row = {f[p, q]: 1.0 for p in have}
                for k, w in t.items():
                    row[k] = row.get(k, 0.0) - w
                rhs = 0.0 if t else 1.0
                self.m.rows.append((row, rhs, rhs))
            for (p, q), col in f.items():
                if p != q:
                    paid[(p, q, phase)].append(col)
        for (p, q, _phase), cols in paid.items():
            c = self._move_time(p, q, size)
            if len(cols) == 1:
                self.m.cost[cols[0]] += c
                continue
            m = self.m.var(c)
            for col in cols:
                self.m.rows.append(({m: 1.0, col: -1.0}, 0.0, math.inf))

    def _keep_split(
        self, v: Value, uses: list[Use], have: dict[Placement, dict[int, float]], x: list[list[int]]
    ) -> None:
        """Forbid every op but a whole-batch reduction to a scalar to read the batch value ``v`` whole
        when it has a Shard: ``Y[v, p] + x[o, s] <= 1`` for each such strategy ``s``. Reading it as
        another Shard (an all-to-all: a concatenation along the batch dim, say) keeps the work split."""
        # NOTE: a graph output may still gather ``v``, and so may an op whose every result is a
        # scalar (the token count of a mean loss: an integer sum, which has no Partial form).
        for u in uses:
            if u.op < 0 or self.scalar_only[u.op]:
                continue
            # NOTE: on a sequence axis (``Problem.sequence_axes``) an attention never reads its
            # queries, keys and values whole, whatever they come from (a partial sum read whole would
            # hand every rank the whole sequence); integers may be read whole by an op that cannot
            # read them in their Shard
            op = self.graph.ops[u.op]
            attends = self.sequence and op.target in RESULT_ROLES and _qkv(op, u.operand)
            ints = self.sequence and isinstance(v.type, TensorType) and not v.type.dtype.is_floating_point
            own = {s.inputs[u.operand] for s in self.per_op[u.op]} if ints else set()
            for s, var in zip(self.per_op[u.op], x[u.op], strict=True):
                q = s.inputs[u.operand]
                if attends and not isinstance(q, Shard):
                    self.m.row_once({var: 1.0}, -math.inf, 0.0)
                for p, t in have.items():
                    if isinstance(p, Shard) and not isinstance(q, Shard) and not (ints and p not in own):
                        self.m.row_once({var: 1.0, **t}, -math.inf, 1.0 if t else 0.0)

    def _move_time(self, p: Placement, q: Placement, size: float) -> float:
        """Time of turning ``p`` into ``q`` for a value of ``size`` bytes on this axis."""
        return self.model.redistribute(p, q, size)


def _qkv(op: Op, index: int) -> bool:
    """Whether operand ``index`` of attention ``op`` is its queries, keys, values, output or output
    gradient (``rules.attention``'s ``qkv`` role)."""
    return OPERAND_ROLES.get(operand_names(op)[index]) == "qkv"


def _frozen(terms: dict[Placement, dict[int, float]]) -> tuple[object, ...]:
    return tuple((p, tuple(t.items())) for p, t in terms.items())
