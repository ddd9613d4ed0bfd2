"""One mixed-integer program handed to HiGHS (``highspy``) and what came back.

The solve is limited by work, never by wall-clock time: HiGHS runs on one thread with a fixed
random seed and stops after ``node_limit`` branch-and-bound nodes, so one program always gives
the same answer on a busy machine and an idle one. Known feasible points (the presets' plans) are
handed over as starting incumbents, so a stopped search is never worse than the best of them.
Being a function of the program alone, a solve is kept: the same program solved again in this
process (the same graph and plan compiled again under another memory policy, or by another test)
gets the first answer without HiGHS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache

import highspy
import numpy as np
from scipy.sparse import coo_array, csc_array, csr_array, diags_array

_FEASIBLE = 2
"""HiGHS's ``kSolutionStatusFeasible``: the point it holds satisfies every row and integrality."""


@dataclass(frozen=True)
class MilpAnswer:
    """The best point found, its objective, the proven lower bound, and whether the search ended by
    proving the optimum (within the relative ``gap`` asked for) or by reaching its node limit."""

    x: np.ndarray | None
    objective: float
    bound: float
    optimal: bool
    nodes: int
    message: str

    @property
    def gap(self) -> float:
        """Relative distance between the point found and the bound: (objective - bound) / objective."""
        if self.x is None:
            return float("inf")
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)


_KEPT: OrderedDict[bytes, MilpAnswer] = OrderedDict()
"""Answers by their program's digest (``_digest``), the most recently used last."""
KEEP = 32
"""At most this many answers kept (each holds one float per column)."""
_LOCK = threading.Lock()


def forget() -> None:
    """Drop the kept answers: the next solve of each program runs HiGHS again (a bench timing
    compiles of one model side by side in one process pays for each as a fresh process would)."""
    with _LOCK:
        _KEPT.clear()


def _digest(*parts: object) -> bytes:
    """A digest of a program's arrays and settings: equal programs, equal digests."""
    h = hashlib.blake2b(digest_size=20)
    for part in parts:
        if isinstance(part, (csc_array, csr_array)):
            h.update(_digest(part.shape, part.indptr, part.indices, part.data))
            continue
        if isinstance(part, dict):
            part = sorted(part.items())
        if isinstance(part, (list, tuple)) and all(isinstance(v, (int, float)) for v in part):
            part = np.asarray(part, dtype=np.float64)
        data = np.ascontiguousarray(part).tobytes() if isinstance(part, np.ndarray) else repr(part).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def _kept(solve: Callable[..., MilpAnswer]) -> Callable[..., MilpAnswer]:
    """``solve``, answering a program it solved before in this process from ``_KEPT`` (a copy)."""

    @functools.wraps(solve)
    def kept(*args: object, **kwargs: object) -> MilpAnswer:
        key = _digest(*args, *sorted(kwargs.items()))
        with _LOCK:
            answer = _KEPT.get(key)
            if answer is not None:
                _KEPT.move_to_end(key)
        if answer is None:
            answer = solve(*args, **kwargs)
            with _LOCK:  # NOTE: compiles on two threads may solve at once
                _KEPT[key] = answer
                while len(_KEPT) > KEEP:
                    _KEPT.popitem(last=False)
        return dataclasses.replace(answer, x=None if answer.x is None else answer.x.copy())

    return kept


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS prints a banner to file descriptor 1 when the first instance is made."""
    try:
        fd = os.dup(1)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(fd, 1)
        os.close(fd)


@cache
def _banner_shown() -> bool:
    with _quiet_stdout():
        highspy.Highs()  # type: ignore[no-untyped-call]
    return True


@_kept
def solve_milp(
    cost: Sequence[float],
    lower: Sequence[float],
    upper: Sequence[float],
    integer: Sequence[int],
    matrix: csc_array,
    row_lower: Sequence[float],
    row_upper: Sequence[float],
    *,
    gap: float,
    node_limit: int,
    start: dict[int, float] | None = None,
    presolve: bool = True,
) -> MilpAnswer:
    """Minimise ``cost @ x`` subject to ``row_lower <= matrix @ x <= row_upper``, ``lower <= x <=
    upper`` and ``x[j]`` integral where ``integer[j]``; ``start``: values of some columns (the
    integral ones of a known plan) from which HiGHS completes a first feasible point; ``presolve``:
    whether HiGHS presolves (see ``AxisProgram``, which decides).

    HiGHS sees the program scaled (each row by its largest coefficient, the costs to a largest of
    1000): byte counts of 1e10 beside costs of 1e-9 seconds would otherwise strain its tolerances."""
    _banner_shown()
    a = csr_array(matrix)
    row_scale = np.ones(a.shape[0])
    if a.nnz:
        row_scale = 1.0 / np.maximum(abs(a).max(axis=1).toarray().ravel(), 1e-12)
    a = csc_array(diags_array(row_scale) @ a)
    c = np.asarray(cost, dtype=np.float64)
    cost_scale = 1e3 / max(float(np.abs(c).max()) if len(c) else 1.0, 1e-30)
    h = highspy.Highs()  # type: ignore[no-untyped-call]
    for name, value in (
        ("output_flag", False),
        ("threads", 1),
        ("random_seed", 0),
        ("mip_rel_gap", gap),
        ("mip_max_nodes", max(node_limit, 1)),  # NOTE: the root node is always solved
        ("time_limit", float("inf")),
        # NOTE: presolve's probing (bit 15) tries each binary at 0 and at 1; on these programs it fixes
        # almost nothing and was most of the solve (Llama3-8B fsdp+tp dp axis: 1.04 of 1.18 s)
        ("presolve_rule_off", 1 << 15),
        ("presolve", "choose" if presolve else "off"),
        # NOTE: the feasibility-jump heuristic never found the incumbent on these programs and cost
        # 0.05-0.15 s a solve (Llama3-8B and -70B dims, DeepSeek-V3 shaped, both mesh axes)
        ("mip_heuristic_run_feasibility_jump", False),
    ):
        h.setOptionValue(name, value)
    lp = highspy.HighsLp()
    n = len(cost)
    lp.num_col_, lp.num_row_ = n, matrix.shape[0]
    lp.col_cost_ = c * cost_scale
    lp.col_lower_ = np.asarray(lower, dtype=np.float64)
    lp.col_upper_ = np.asarray(upper, dtype=np.float64)
    lp.row_lower_ = np.asarray(row_lower, dtype=np.float64) * row_scale
    lp.row_upper_ = np.asarray(row_upper, dtype=np.float64) * row_scale
    a.sort_indices()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = a.indptr.astype(np.int32)
    lp.a_matrix_.index_ = a.indices.astype(np.int32)
    lp.a_matrix_.value_ = a.data.astype(np.float64)
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, matrix.shape[0]
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integer]
    h.passModel(lp)
    if start:
        cols = np.fromiter(start, dtype=np.int32, count=len(start))
        h.setSolution(len(cols), cols, np.fromiter(start.values(), dtype=np.float64, count=len(start)))
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    ok = info.primal_solution_status == _FEASIBLE
    x = np.asarray(h.getSolution().col_value, dtype=np.float64) if ok and n else None
    objective = float(np.dot(c, x)) if x is not None else float("inf")
    optimal = status == highspy.HighsModelStatus.kOptimal
    if not any(integer):
        bound = objective if optimal else -float("inf")  # NOTE: a linear program: no branch and bound
    else:
        bound = float(info.mip_dual_bound) / cost_scale if np.isfinite(info.mip_dual_bound) else -float("inf")
    return MilpAnswer(
        x=x,
        objective=objective,
        bound=min(bound, objective),
        optimal=optimal,
        nodes=int(info.mip_node_count),
        message=h.modelStatusToString(status),
    )


class Columns:
    """A program being built: columns (cost, bounds, integrality) and sparse rows ``lo <= row <= hi``."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self.seen: dict[Hashable, int] = {}
        """What ``once`` has built: its key → its build's number."""
        self.builds: list[tuple[int, tuple[float, ...]]] = []
        """Each build's first column and the costs of the columns it added."""
        self.copies: list[int] = []
        """How many more copies of each build ``fold`` added (priced at ``solve``)."""
        self.rows_seen: set[Hashable] = set()
        self.folded = 0

    def var(self, cost: float, lo: float = 0.0, hi: float = 1.0, integer: bool = False) -> int:
        self.cost.append(cost)
        self.lo.append(lo)
        self.hi.append(hi)
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def once(self, key: Hashable, build: Callable[[], None]) -> int:
        """Run ``build`` (which adds columns and rows) unless a call with the same ``key`` ran before:
        then fold this one into that one, whose columns' costs grow by their first costs again.
        ``key`` must say everything ``build`` depends on (a mirrored block's value: the same size,
        placements and consumers' columns). Exact: two identical copies of a set of columns under
        the same rows take the same values at an optimum. Returns the build's number (for ``fold``)."""
        done = self.seen.get(key)
        if done is not None:
            self.fold(done)
            return done
        n0 = len(self.cost)
        build()
        self.builds.append((n0, tuple(self.cost[n0:])))
        self.copies.append(0)
        self.seen[key] = len(self.builds) - 1
        return len(self.builds) - 1

    def fold(self, done: int) -> None:
        """One more copy of build ``done`` (a number ``once`` returned): its columns' costs grow by
        their first costs again."""
        self.copies[done] += 1
        self.folded += 1

    def _price_copies(self) -> None:
        for done, n in enumerate(self.copies):
            if n:
                first, costs = self.builds[done]
                for i, c in enumerate(costs):
                    self.cost[first + i] += n * c
                self.copies[done] = 0

    def row_once(self, row: dict[int, float], lo: float, hi: float) -> None:
        """Add a row unless the same row was added before."""
        key = (tuple(row.items()), lo, hi)
        if key not in self.rows_seen:
            self.rows_seen.add(key)
            self.rows.append((row, lo, hi))

    def solve(
        self, *, gap: float, node_limit: int, start: dict[int, float] | None = None, presolve: bool = True
    ) -> MilpAnswer:
        self._price_copies()
        n = len(self.cost)
        if n == 0:  # NOTE: nothing to choose (no ops, nothing moves): HiGHS needs a column
            return MilpAnswer(np.zeros(0), 0.0, 0.0, True, 0, "empty")
        r_idx: list[int] = []
        c_idx: list[int] = []
        vals: list[float] = []
        for r, (row, _, _) in enumerate(self.rows):
            r_idx.extend([r] * len(row))
            c_idx.extend(row)
            vals.extend(row.values())
        a = coo_array((vals, (r_idx, c_idx)), shape=(len(self.rows), n)).tocsc()
        lo = [lb for _, lb, _ in self.rows]
        hi = [ub for _, _, ub in self.rows]
        return solve_milp(
            self.cost,
            self.lo,
            self.hi,
            self.integer,
            a,
            lo,
            hi,
            gap=gap,
            node_limit=node_limit,
            start=start,
            presolve=presolve,
        )
