"""One cell of the matrix, run on every rank of a pool: an entry compiled under a column's plan and
trained beside the same model on one device.

Each rank builds the model twice (the same seeded weights), compiles one copy with ``parallelize``
and trains both for ``steps`` AdamW steps on the entry's inputs, comparing after every backward
the loss and every gradient (the compiled module's parameters are DTensors under the model's
FQNs; a pipelined rank holds its stages' only), and the parameters after the last step. It
reports one of:

* ``equal``: every comparison held;
* ``refused``: compiling or the first call raised meshfold's own error (``PassError`` or
  ``CaptureError``, a pass's own refusal among them, not a pass that crashed), before any
  collective of a program;
* ``differs``: the program ran but a value differed (what, by how much).

Anything else (another exception, a rank that died or hung) reaches the pool as a failure; the
matrix (``meshfold.tools.corpus.matrix``) counts that, and ``differs``, as ``FAIL``.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any

import torch
from torch import nn

from meshfold.rewrites.moe_lists import as_stacked
from meshfold.tools.corpus import catalog as registry
from meshfold.tools.corpus import columns as plans
from meshfold.tools.corpus import entries as corpus_entries
from meshfold.tools.corpus.near_ties import BOUND, Ties
from meshfold.tools.pool_worker import device_mesh

LR = 1e-3
# NOTE: Adam's step is about lr * g/|g|; eps=1e-6 keeps the step of a gradient near zero proportional
# to it on both sides (with torch's 1e-8, float noise in a 1e-9 gradient would move its parameter by a
# sizeable part of lr, differently under any other summation order)
EPS = 1e-6
TOLERANCES = {"fp32": (1e-5, 1e-4, 0.05 * LR), "bf16": (2e-3, 2e-2, 0.25 * LR)}
"""(loss, gradient, parameter) tolerances by what an entry computes in (``Entry.precision``): the
loss's and a gradient's relative, the parameters' absolute after the AdamW steps. NOTE: a gradient
is compared as a whole against its own largest entry: float32 sums in another order (a sharded
matmul, a reduce-scatter) differ by ~1e-6 of it, a wrong term by far more; bf16 rounds at 2^-8 and a
split batch rounds each part apart. Adam's step is about lr * g/|g|, so parameters must agree to a
share of one step (5% in fp32), which any wrong update exceeds."""
GRAD_FLOOR = 1e-4
"""A gradient's scale is at least this share of the model's largest gradient entry: one that is zero
in exact arithmetic (a key bias under softmax, which adds the same to every score) holds float noise
around 1e-11, which no two summation orders agree on."""
SEED = 1234
MAX_FLIPS = 3
"""At most this many near ties of one step resolved the other way (``_Compare``)."""
MAX_TIES = 16
"""Of a step's near ties, the nearest this many are tried (each try is one single-device step)."""


def run(entry: str, column: str, steps: int = 3, verify: bool = False) -> dict[str, Any]:
    """Run cell (``entry``, ``column``) on this rank; returns ``{"status", "message", ...}`` (the
    module docstring says what each status means)."""
    from meshfold.api import parallelize
    from meshfold.passes.base import PassError, PassFailure
    from meshfold.tracing.tracer import CaptureError

    warnings.filterwarnings("ignore")
    e, col = corpus_entries.get(entry), plans.column(column)
    mesh = device_mesh(col.shape, col.names)
    net, inputs = e.build()
    ref, _ = e.build()
    started = time.perf_counter()
    torch.manual_seed(SEED)
    try:
        pm = parallelize(net, mesh, inputs, verify=verify, **col.kwargs())
        compiled = time.perf_counter() - started
        train = _Pipelined(pm, e) if col.pipelined else _Compiled(pm, e)
        first = train.step(inputs)
    except (PassError, CaptureError) as err:
        # NOTE: a pass that raised anything but meshfold's own errors crashed (on rank 0, which compiled;
        # the other ranks raise its text as a PassError, and rank 0's failure makes the cell FAIL)
        if isinstance(err, PassFailure) and not isinstance(err.__cause__, (PassError, CaptureError)):
            raise
        return {"status": "refused", "message": f"{type(err).__name__}: {err}"}
    out = _Compare(ref, e, train, steps).run(inputs, first)
    out["compile_s"] = round(compiled, 2)
    out["seconds"] = round(time.perf_counter() - started, 2)
    if col.pipelined:
        pm.close()
    return out


class _Compiled:
    """Trains a ``ParallelModule``: a call, then ``backward``."""

    def __init__(self, pm: nn.Module, entry: registry.Entry) -> None:
        self.pm, self.entry = pm, entry
        self.opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)

    def step(self, inputs: tuple[Any, ...]) -> torch.Tensor:
        loss = self.entry.loss(self.pm(*inputs))
        loss.backward()
        return loss.detach()

    def stacks(self) -> tuple[Any, ...]:
        return tuple(self.pm.graph().stacks)


class _Pipelined(_Compiled):
    """Trains a ``PipelinedModule``: ``pm.step`` (forward and backward by the schedule)."""

    def step(self, inputs: tuple[Any, ...]) -> torch.Tensor:
        return self.pm.step(*inputs).detach()

    def stacks(self) -> tuple[Any, ...]:
        return tuple(s for stage in self.pm.stages() for s in self.pm.stage_graph(stage).stacks)


class _Compare:
    """Steps the single-device model beside ``train`` and reports the first difference.

    Where a step differs and the single-device forward made top-k decisions at near ties
    (``meshfold.tools.corpus.near_ties``), the single-device step is run again with ties (the
    ``MAX_TIES`` nearest) resolved the other way, one at a time and then greedily up to
    ``MAX_FLIPS``; a run that the program then equals within every tolerance is the step's reference
    (the single-device model trains on from it), and the cell's message names the ties."""

    def __init__(self, ref: nn.Module, entry: registry.Entry, train: _Compiled, steps: int) -> None:
        self.ref, self.entry, self.train, self.steps = ref, entry, train, steps
        self.opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
        self.stacks = train.stacks()
        self.tolerances = TOLERANCES[entry.precision]
        self.resolved: list[str] = []

    def run(self, inputs: tuple[Any, ...], first: torch.Tensor) -> dict[str, Any]:
        torch.manual_seed(SEED)  # NOTE: the program's generator was seeded from this state (random ops draw alike)
        worst = {"loss": 0.0, "grad": 0.0}
        for step in range(self.steps):
            loss = first if step == 0 else self.train.step(inputs)
            got = self._compiled_grads()
            problem = self._step(step, inputs, float(loss), got, worst)
            if problem:
                return {"status": "differs", "message": problem, **worst}
            self.train.opt.step()
            self.opt.step()
            self.train.opt.zero_grad(set_to_none=True)
            self.opt.zero_grad(set_to_none=True)
        problem = self._params()
        ties = f"equal once {len(self.resolved)} near ties resolved the other way: " + "; ".join(self.resolved)
        message = problem or (ties if self.resolved else "")
        return {"status": "differs" if problem else "equal", "message": message, **worst}

    def _step(
        self, step: int, inputs: tuple[Any, ...], loss: float, got: dict[str, Any], worst: dict[str, float]
    ) -> str:
        """Run the single-device step and compare; on a difference, try its near ties resolved the
        other way. Returns the first difference, or "" where the step (perhaps so resolved) is equal."""
        rng, buffers = torch.get_rng_state(), {n: b.clone() for n, b in self.ref.named_buffers()}
        before = dict(worst)
        self._reference_step(inputs, None)
        problem, score = self._check(step, loss, got, worst)
        if not problem:
            return ""
        self._restore(rng, buffers)
        ties = self._reference_step(inputs, frozenset())
        assert ties is not None
        nearest = sorted(ties.ties, key=lambda t: t.relative)[:MAX_TIES]
        candidates = [(t.call, t.row) for t in nearest]
        chosen: frozenset[tuple[int, int]] = frozenset()
        for _ in range(MAX_FLIPS if candidates else 0):
            best: tuple[float, frozenset[tuple[int, int]]] | None = None
            for c in (c for c in candidates if c not in chosen):
                trial = chosen | {c}
                self._restore(rng, buffers)
                self._reference_step(inputs, trial)
                found, trial_score = self._check(step, loss, got, None)
                if not found:
                    worst.update(before)
                    self._check(step, loss, got, worst)
                    self.resolved += [f"step {step}: {t}" for t in ties.ties if (t.call, t.row) in trial]
                    return ""
                if best is None or trial_score < best[0]:
                    best = (trial_score, trial)
            if best is None or best[0] >= score:
                break
            score, chosen = best
        return problem

    def _reference_step(self, inputs: tuple[Any, ...], flip: frozenset[tuple[int, int]] | None) -> Ties | None:
        """The single-device model's forward and backward on ``inputs``: plainly where ``flip`` is
        None, else recording its near ties and resolving those in ``flip`` the other way."""
        self.opt.zero_grad(set_to_none=True)
        ties = None if flip is None else Ties(BOUND[self.entry.precision], flip)
        with ties if ties is not None else contextlib.nullcontext():
            ref_loss = self.entry.loss(self.ref(*inputs))
        ref_loss.backward()
        self.ref_loss = float(ref_loss.detach())
        return ties

    def _restore(self, rng: torch.Tensor, buffers: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for n, b in self.ref.named_buffers():
                b.copy_(buffers[n])

    def _compiled_grads(self) -> dict[str, torch.Tensor | None]:
        """Every gradient of the compiled module, whole (the collectives of ``full_tensor`` run here,
        once a step, on every rank alike)."""
        return {n: None if p.grad is None else _full(p.grad) for n, p in self.train.pm.named_parameters()}

    def _check(
        self, step: int, loss: float, got: dict[str, torch.Tensor | None], worst: dict[str, float] | None
    ) -> tuple[str, float]:
        """The first difference of this step's loss and gradients from the single-device step's (""
        where none), and the largest error as a share of its tolerance; ``worst`` takes the errors."""
        worst = worst if worst is not None else {"loss": 0.0, "grad": 0.0}
        ref = self.ref_loss
        err = abs(loss - ref) / max(abs(ref), 1e-6)
        worst["loss"] = max(worst["loss"], err)
        score = err / self.tolerances[0]
        if not math.isfinite(loss) or err > self.tolerances[0]:
            return f"step {step}: loss {loss:.6g}, single device {ref:.6g} (relative {err:.2e})", math.inf
        want = self._reference("grad")
        floor = GRAD_FLOOR * max((float(g.abs().max()) for g in want.values() if g is not None), default=0.0)
        first = ""
        for name, g in got.items():
            if name not in want:
                return f"step {step}: the compiled module has a parameter {name!r} the model lacks", math.inf
            if (g is None) != (want[name] is None):
                side = "compiled" if g is None else "single-device"
                return f"step {step}: grad {name} is None on the {side} side only", math.inf
            if g is None:
                continue
            scale = max(float(want[name].abs().max()), floor, 1e-12)
            err = float((g - want[name]).abs().max()) / scale
            worst["grad"] = max(worst["grad"], err)
            score = max(score, err / self.tolerances[1]) if math.isfinite(err) else math.inf
            if not first and (not math.isfinite(err) or err > self.tolerances[1]):
                first = f"step {step}: grad {name} differs by {err:.2e} of its largest entry ({scale:.3g})"
        return first, score

    def _params(self) -> str:
        want = self._reference("param")
        for name, p in self.train.pm.named_parameters():
            err = float((_full(p.detach()) - want[name]).abs().max())
            if err > self.tolerances[2]:
                return f"param {name} after {self.steps} AdamW steps differs by {err:.2e} (lr {LR})"
        return ""

    def _reference(self, what: str) -> dict[str, Any]:
        own = {
            n: (p.detach() if what == "param" else p.grad) for n, p in self.ref.named_parameters(remove_duplicate=False)
        }
        return as_stacked(self.stacks, own) if self.stacks else own


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
