"""Near ties in the single-device model's top-k decisions, and running it with some of them resolved
the other way.

A router that picks its experts by top-k (or top-1: ``argmax``, ``max`` along a dim) is
discontinuous: where a token's k-th and (k+1)-th best scores differ by less than the rounding a
correct plan may move them by (another summation order, a bf16 matmul split in two), the program
and the single-device model may pick different experts, and that expert's gradients then differ by
a whole token's share. Such a cell is not wrong: the program computed the model's function with one
tie broken the other way. ``Ties`` records, on the single-device side, every selection
(``aten.topk``; ``argmax``/``argmin`` and ``max``/``min`` along a dim as top-1) whose k-th and
(k+1)-th values lie within ``bound`` of each other (relative), and runs the model with chosen ones
resolved the other way: the (k+1)-th candidate takes the k-th's place, with its value. The
comparison (``meshfold.tools.corpus.cell``) accepts a step only if the program then equals that run
within the usual tolerances, so a wrong value is never explained away.
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
    ``call``-th selection op in one forward, made in module ``where``: its k-th candidate
    ``chosen`` and the next one, ``other``, ``margin`` apart."""

    call: int
    row: int
    where: str
    chosen: int
    other: int
    value: float
    margin: float

    @property
    def relative(self) -> float:
        """``margin`` relative to the k-th value (what ``bound`` is compared with)."""
        return self.margin / max(abs(self.value), 1e-30)

    def __str__(self) -> str:
        return (
            f"{self.where}: top-k row {self.row} took {self.chosen} over {self.other} "
            f"(scores {self.margin:.2g} apart of {abs(self.value):.3g})"
        )


class Ties(TorchDispatchMode):
    """Inside this mode, every selection op is recorded in ``ties`` where it has near ties, and the
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
        if func not in SELECTIONS:
            return out
        x, kw = args[0], kwargs or {}
        whole = None if func in INDICES_ONLY else -1
        dim = _arg(args, kw, 2 if func is aten.topk.default else 1, "dim", whole)
        if dim is None or x.is_complex() or not x.is_floating_point() or x.dim() == 0:
            return out  # NOTE: an argmax over the whole tensor picks no expert per token
        call, self.calls = self.calls, self.calls + 1
        if func is aten.topk.default:
            k, largest = args[1], _arg(args, kw, 3, "largest", True)
            return out if k >= x.shape[dim] else self._resolve(call, out, x, k, dim, largest)
        if x.shape[dim] < 2:
            return out
        largest = func in (aten.max.dim, aten.argmax.default)
        # NOTE: a top-1 selection, its dim kept, as topk gives it
        kept = _arg(args, kw, 2, "keepdim", False)
        indices = out if func in INDICES_ONLY else out[1]
        indices = indices if kept else indices.unsqueeze(dim)
        top1 = (x.gather(dim, indices), indices)
        values, indices = resolved = self._resolve(call, top1, x, 1, dim, largest)
        if resolved is top1:
            return out
        values, indices = (values, indices) if kept else (values.squeeze(dim), indices.squeeze(dim))
        return indices if func in INDICES_ONLY else (values, indices)

    def _resolve(self, call: int, out: Any, x: torch.Tensor, k: int, dim: int, largest: bool) -> Any:
        values, indices = out
        wide_v, wide_i = torch.topk(x.detach(), k + 1, dim, largest, True)
        rows_v, rows_i = _rows(wide_v, dim), _rows(wide_i, dim)
        kth, nxt = rows_v[:, k - 1], rows_v[:, k]
        margin = (kth - nxt).abs()
        near = (margin <= self.bound * kth.abs().clamp_min(torch.finfo(x.dtype).tiny)).nonzero().flatten().tolist()
        where = max(self.tracker.parents, key=len)
        out_v, out_i = _rows(values, dim).clone(), _rows(indices, dim).clone()
        flipped = False
        for r in near:
            # NOTE: by index, from what the op chose: at an exact tie topk's k+1 may order them otherwise
            slot = int((out_v[r] - kth[r]).abs().argmin())
            taken = set(out_i[r].tolist())
            chosen, other = int(out_i[r, slot]), next(int(i) for i in rows_i[r] if int(i) not in taken)
            self.ties.append(Tie(call, r, where, chosen, other, float(kth[r]), float(margin[r])))
            if (call, r) in self.flip:
                out_i[r, slot], out_v[r, slot] = other, nxt[r]
                flipped = True
        return (_unrows(out_v, values, dim), _unrows(out_i, indices, dim)) if flipped else out


INDICES_ONLY = frozenset({aten.argmax.default, aten.argmin.default})
SELECTIONS = INDICES_ONLY | {aten.topk.default, aten.max.dim, aten.min.dim}
"""The ops a router picks its experts with: top-k, and top-1 along a dim (``INDICES_ONLY`` return no
values)."""


def _arg(args: Any, kwargs: dict[str, Any], at: int, name: str, default: Any) -> Any:
    """An op's argument ``name``, given at position ``at`` or by keyword."""
    return args[at] if len(args) > at else kwargs.get(name, default)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``[rows, k]``, the selected dim last."""
    return t.movedim(dim, -1).reshape(-1, t.shape[dim])


def _unrows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """``rows`` (``_rows`` of a tensor shaped as ``like``) back in ``like``'s shape, contiguous."""
    return rows.reshape(like.movedim(dim, -1).shape).movedim(-1, dim).contiguous()
