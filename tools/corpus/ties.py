"""Near ties in the single-device model's top-k decisions, and running it with some of them resolved
the other way.

A top-k router is discontinuous: where a token's k-th and (k+1)-th best scores differ by less than
the rounding a correct plan may move them by (another summation order, a bf16 matmul split in two),
the program and the single-device model may pick different experts, and that expert's gradients
then differ by a whole token's share. Such a cell is not wrong: the program computed the model's
function with one tie broken the other way. ``Ties`` records, on the single-device side, every
``aten.topk`` whose k-th and (k+1)-th values lie within ``bound`` of each other (relative), and
runs the model with chosen ones resolved the other way: the (k+1)-th candidate takes the k-th's
place, with its value. The comparison (``meshfold.tools.corpus.cell``) accepts a step only if the
program then equals that run within the usual tolerances, so a wrong value is never explained away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

aten = torch.ops.aten

BOUND = {"fp32": 1e-5, "bf16": 2.0**-8}
"""How close (relative to the k-th value) two top-k candidates are to count as a near tie, by what an
entry computes in: bf16's unit roundoff where its code rounds to bf16, else 1e-5."""


@dataclass(frozen=True)
class Tie:
    """The ``row``-th top-k selection (rows in the order of the flattened non-selected dims) of the
    ``call``-th ``aten.topk`` in one forward, made in module ``where``: its k-th candidate
    ``chosen`` and the next one, ``other``, ``margin`` apart."""

    call: int
    row: int
    where: str
    chosen: int
    other: int
    value: float
    margin: float

    def __str__(self) -> str:
        return (
            f"{self.where}: top-k row {self.row} took {self.chosen} over {self.other} "
            f"(scores {self.margin:.2g} apart of {abs(self.value):.3g})"
        )


class Ties(TorchDispatchMode):
    """Inside this mode, every ``aten.topk`` is recorded in ``ties`` where it has near ties, and the
    ties in ``flip`` (by ``(call, row)``) are resolved the other way. Every forward under a new mode
    numbers its calls from 0, so the same model and inputs give the same ties."""

    def __init__(self, bound: float, flip: frozenset[tuple[int, int]] = frozenset()) -> None:
        super().__init__()
        self.bound, self.flip = bound, flip
        self.ties: list[Tie] = []
        self.calls = 0
        self.tracker = ModuleTracker()

    def __enter__(self) -> Ties:
        self.tracker.__enter__()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is not aten.topk.default:
            return out
        call, self.calls = self.calls, self.calls + 1
        x, k = args[0], args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1) if kwargs else -1
        largest = args[3] if len(args) > 3 else (kwargs or {}).get("largest", True)
        if k >= x.shape[dim] or x.is_complex() or not x.is_floating_point():
            return out
        return self._resolve(call, out, x, k, dim, largest)

    def _resolve(self, call: int, out: Any, x: torch.Tensor, k: int, dim: int, largest: bool) -> Any:
        values, indices = out
        wide_v, wide_i = torch.topk(x.detach(), k + 1, dim, largest, True)
        rows_v, rows_i = _rows(wide_v, dim), _rows(wide_i, dim)
        kth, nxt = rows_v[:, k - 1], rows_v[:, k]
        margin = (kth - nxt).abs()
        near = (margin <= self.bound * kth.abs().clamp_min(torch.finfo(x.dtype).tiny)).nonzero().flatten().tolist()
        where = max(self.tracker.parents, key=len)
        for r in near:
            self.ties.append(
                Tie(call, r, where, int(rows_i[r, k - 1]), int(rows_i[r, k]), float(kth[r]), float(margin[r]))
            )
        rows = [r for r in near if (call, r) in self.flip]
        if not rows:
            return out
        out_v, out_i = _rows(values, dim).clone(), _rows(indices, dim).clone()
        for r in rows:
            slot = (out_i[r] == rows_i[r, k - 1]).nonzero().flatten()[0]
            out_i[r, slot], out_v[r, slot] = rows_i[r, k], rows_v[r, k]
        return _unrows(out_v, values, dim), _unrows(out_i, indices, dim)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``[rows, k]``, the selected dim last."""
    return t.movedim(dim, -1).reshape(-1, t.shape[dim])


def _unrows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """``rows`` (``_rows`` of a tensor shaped as ``like``) back in ``like``'s shape, contiguous."""
    return rows.reshape(like.movedim(dim, -1).shape).movedim(-1, dim).contiguous()
