"""``ring-steps``: ring attention written out as its steps, so its point-to-point passes are ops of
the program that the overlap pass schedules beside everything else.

An attention kernel whose queries, keys and values are split along the sequence over one mesh axis
of ``n`` ranks (the ring strategy, ``rules.attention``) runs as one op that passes the keys and
values round the ring inside itself (``backends/context_parallel/ring_lowering.py``). Where its schedule is fixed
before anything runs (no mask tensor, whose reach is known only from its contents; no dropout),
this pass replaces the forward kernel by (``ir.dialects.ring``)::

    q, k, v = ppermute(q, k, v; zigzag)           # causal only: every rank the same work
    out, lse = ring_step(q, k, v; step 0)
    for s in 1 .. n-1:
        k, v = ppermute(k, v; shift)               # now rank r holds the keys of rank r - s
        out, lse = lse_merge(out, lse, ring_step(q, k, v; step s))
    out, lse = ppermute(out, lse; unzigzag)

and its backward by the same steps' ``ring_step_backward``: the query gradients add up where they
are; the gradients of the keys and values a rank is passed travel on with them (each step's ``+``
of what arrives by ``shift`` and what the step adds) and, after the last step, one more ``shift``
takes them home, where the rank's own block's are added. Every step's ``ppermute`` depends only on
the one before it, so the overlap pass starts it before the step that computes meanwhile.

Forward and backward pass the keys and values each (the backward does not keep the forward's
copies: that would hold ``n`` blocks of them). The zigzag exchanges are ``ppermute``s of half-chunks.

Under ``cp={"method": "tokenring"}`` the keys and values stay and the queries travel instead
(``_TokenSteps``), one way round the ring: at step ``s`` rank ``r`` holds the queries of rank
``r - s`` (passed on one rank per step, like ring attention's keys, so they travel while the step
before computes), computes them against its own keys (``ring_step``'s ``qstep``) and sends the
result and its log-sum-exp straight back the other way (``shift_order(n, -s)``), where it is merged.
Backward: the queries, the output's gradient, the output and its log-sum-exp go round; the query
gradients come straight back; the key and value gradients stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from meshfold.ir import Graph, GraphBuilder, Op, Shard, TensorType, Value
from meshfold.ir.dialects.ring import LSE_MERGE, RING_STEP, RING_STEP_BACKWARD, inverse, shift_order, zigzag_order
from meshfold.ir.graph import fresh_name
from meshfold.ir.ops import PPERMUTE
from meshfold.ir.symbolic import divides
from meshfold.passes.base import Pass
from meshfold.passes.cp import method_of
from meshfold.passes.sharding.boxing import BOXED
from meshfold.passes.sharding.rules.attention import RING_KERNELS
from meshfold.passes.sharding.rules.operands import op_arg

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

FORWARD, BACKWARD = RING_KERNELS[0], RING_KERNELS[1]
_ADD = torch.ops.aten.add.Tensor


@dataclass(frozen=True)
class RingSteps(Pass):
    """Ring attention as ``comm.ppermute`` and ``meshfold.ring_step`` ops (see the module doc)."""

    name: ClassVar[str] = "ring-steps"
    requires: ClassVar[frozenset[str]] = frozenset({BOXED})
    ensures: ClassVar[frozenset[str]] = frozenset()
    invalidates: ClassVar[frozenset[str]] = frozenset()

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        if graph.mesh is None:
            return graph
        steps = _TokenSteps if method_of(ctx) == "tokenring" else _Steps
        rings = {op: axis for op in graph.ops if (axis := ring_axis(graph, op)) is not None}
        if not rings:
            return graph
        names = {i.value.name for i in graph.inputs} | {r.name for op in graph.ops for r in op.results}
        b = GraphBuilder.like(graph)
        for op in graph.ops:
            axis = rings.get(op)
            if axis is None:
                b.append(op)
            else:
                steps(b, op, axis, graph.mesh.size(axis), names).emit()
        for o in graph.outputs:
            b.add_output(o.kind, o.name, o.value)
        _report(ctx, {a: graph.mesh.size(a) for a in graph.mesh.names}, rings, method_of(ctx))
        return b.build()


def _report(ctx: PassContext, sizes: dict[str, int], rings: dict[Op, str], method: str) -> None:
    """A plan report line per axis (``passes.sharding.ilp.problem.solve_report``): how many forward
    attentions run as steps."""
    lines = []
    what = "queries and results" if method == "tokenring" else "keys and values"
    kind = "TokenRing attentions" if method == "tokenring" else "ring attentions"
    for axis in sizes:
        n = sum(1 for op, a in rings.items() if a == axis and op.target == FORWARD)
        if n:
            lines.append(
                f"context parallel on {axis!r}: {n} {kind} as {sizes[axis]} steps each, their {what} "
                "passed by comm.ppermute ops the overlap pass schedules"
            )
    ctx.stats["cp.ring_steps"] = tuple(lines)


def ring_axis(graph: Graph, op: Op) -> str | None:
    """The mesh axis ``op`` runs ring attention over when its steps can be written out: a CPU flash
    kernel (forward or backward) whose queries are split along the sequence over one axis of more
    than one rank, with no mask tensor and no dropout, and (causal: zigzag halves) an even split."""
    if op.target not in (FORWARD, BACKWARD) or graph.mesh is None:
        return None
    q = op.operands[1 if op.target == BACKWARD else 0]
    if not isinstance(q.type, TensorType) or q.type.rank != 4:
        return None
    axes = [a for a in graph.mesh.names if q.layout.placement(a) == Shard(2)]
    if len(axes) != 1 or graph.mesh.size(axes[0]) < 2:
        return None
    if op_arg(op, "attn_mask") is not None or op_arg(op, "dropout_p", 0.0) not in (0, 0.0):
        return None
    pieces = graph.mesh.size(axes[0]) * (2 if op_arg(op, "is_causal", False) else 1)
    return axes[0] if divides(q.type.shape[2], pieces) else None


class _Steps:
    """Writes one ring attention op's steps into ``b``."""

    def __init__(self, b: GraphBuilder, op: Op, axis: str, n: int, names: set[str]) -> None:
        self.b, self.op, self.axis, self.n, self.names = b, op, axis, n, names
        self.causal = bool(op_arg(op, "is_causal", False))
        self.scale = op_arg(op, "scale")

    def emit(self) -> None:
        if self.op.target == FORWARD:
            self._forward()
        else:
            self._backward()

    def _value(self, like: Value, tag: str) -> Value:
        return Value(fresh_name(f"{like.name}_{tag}", self.names), like.type, like.layout)

    def _call(
        self, target: object, args: tuple[object, ...], likes: list[Value], tag: str, into: list[Value] | None = None
    ) -> list[Value]:
        """One op on ``args``; its results like ``likes`` (or ``into``, the replaced op's own results)."""
        results = into if into is not None else [self._value(x, tag) for x in likes]
        self.b.append(Op(target, args, (), tuple(results), self.op.prov))  # type: ignore[arg-type]
        return results

    def _permute(self, x: Value, order: tuple[int, ...], tag: str, into: Value | None = None) -> Value:
        r = into if into is not None else self._value(x, tag)
        kwargs = (("axis", self.axis), ("dim", 2), ("order", order))
        self.b.append(Op(PPERMUTE, (x,), kwargs, (r,), self.op.prov))  # type: ignore[arg-type]
        return r

    def _zigzag(self, xs: list[Value]) -> list[Value]:
        return [self._permute(x, zigzag_order(self.n), "zz") for x in xs] if self.causal else xs

    def _last(self, into: list[Value]) -> list[Value] | None:
        """Where the last step writes: the replaced op's results, unless the zigzag's way back does."""
        return None if self.causal else into

    def _home(self, xs: list[Value], into: list[Value]) -> None:
        """``xs`` (zigzag) back to the contiguous split as ``into`` (the replaced op's results)."""
        if self.causal:
            for x, r in zip(xs, into, strict=True):
                self._permute(x, inverse(zigzag_order(self.n)), "home", r)

    def _how(self, step: int, qstep: int = 0) -> tuple[object, ...]:
        return (-1, self.n, step, self.causal, self.causal, self.scale, qstep)

    def _forward(self) -> None:
        q, k, v = self.op.operands[:3]
        out, lse = self.op.results[:2]
        q, k, v = self._zigzag([q, k, v])
        o, lo = self._call(RING_STEP, (q, k, v, *self._how(0)), [out, lse], "s0")
        held = self._travels(q, k, v)
        for s in range(1, self.n):
            os_, ls, held = self._step(s, q, k, v, held, [out, lse])
            last = self._last([out, lse]) if s == self.n - 1 else None
            o, lo = self._call(LSE_MERGE, (o, lo, os_, ls), [out, lse], f"m{s}", last)
        self._home([o, lo], [out, lse])

    def _travels(self, q: Value, k: Value, v: Value) -> tuple[Value, ...]:
        """What goes round the ring in the forward: the keys and values."""
        return (k, v)

    def _step(
        self, s: int, q: Value, k: Value, v: Value, held: tuple[Value, ...], like: list[Value]
    ) -> tuple[Value, Value, tuple[Value, ...]]:
        """Forward step ``s``: its output and log-sum-exp for this rank's queries, and what travels,
        as held after the step (ring attention: the keys and values of the rank before, passed on)."""
        k, v = (self._permute(x, shift_order(self.n), f"s{s}") for x in held)
        os_, ls = self._call(RING_STEP, (q, k, v, *self._how(s)), like, f"s{s}")
        return os_, ls, (k, v)

    def _backward(self) -> None:
        grad, q, k, v, out, lse = self.op.operands[:6]
        dq_r, dk_r, dv_r = self.op.results[:3]
        grad, q, k, v, out, lse = self._zigzag([grad, q, k, v, out, lse])
        shift = shift_order(self.n)
        args = (grad, q, k, v, out, lse)
        dq, dk, dv = self._call(RING_STEP_BACKWARD, (*args, *self._how(0)), [q, k, v], "g0")
        ak: Value | None = None
        av: Value | None = None
        for s in range(1, self.n):
            k, v = (self._permute(x, shift, f"s{s}") for x in (k, v))
            gq, gk, gv = self._call(RING_STEP_BACKWARD, (grad, q, k, v, out, lse, *self._how(s)), [q, k, v], f"g{s}")
            (dq,) = self._call(_ADD, (dq, gq), [dq], f"g{s}", self._last([dq_r]) if s == self.n - 1 else None)
            if ak is None or av is None:
                ak, av = gk, gv
            else:  # NOTE: what the ranks before added to the held block arrives beside it
                (ak,) = self._call(_ADD, (gk, self._permute(ak, shift, f"a{s}")), [gk], f"a{s}")
                (av,) = self._call(_ADD, (gv, self._permute(av, shift, f"a{s}")), [gv], f"a{s}")
        assert ak is not None and av is not None, "a ring has two ranks at least"
        # NOTE: the last holder sends them home, one more shift on
        (dk,) = self._call(_ADD, (dk, self._permute(ak, shift, "back")), [dk], "back", self._last([dk_r]))
        (dv,) = self._call(_ADD, (dv, self._permute(av, shift, "back")), [dv], "back", self._last([dv_r]))
        self._home([dq, dk, dv], [dq_r, dk_r, dv_r])


class _TokenSteps(_Steps):
    """Writes one attention op's TokenRing steps into ``b``: the keys and values stay; the queries go
    round the ring one rank per step (``shift_order(n)``: at step ``s`` rank ``r`` holds those of rank
    ``r - s``) and each step's results go straight back to their owner (``shift_order(n, -s)``), the
    other way, to be merged there. Backward: the queries, the output's gradient, the output and its
    log-sum-exp go round the same way, the query gradients come straight back, the key and value
    gradients add up where they are."""

    def _travels(self, q: Value, k: Value, v: Value) -> tuple[Value, ...]:
        return (q,)

    def _step(
        self, s: int, q: Value, k: Value, v: Value, held: tuple[Value, ...], like: list[Value]
    ) -> tuple[Value, Value, tuple[Value, ...]]:
        """The queries of the rank ``s`` before against this rank's keys; the results back to them."""
        (there,) = (self._permute(x, shift_order(self.n), f"t{s}") for x in held)
        os_, ls = self._call(RING_STEP, (there, k, v, *self._how(0, s)), like, f"s{s}")
        back_o, back_l = (self._permute(x, shift_order(self.n, -s), "back") for x in (os_, ls))
        return back_o, back_l, (there,)

    def _backward(self) -> None:
        grad, q, k, v, out, lse = self.op.operands[:6]
        dq_r, dk_r, dv_r = self.op.results[:3]
        grad, q, k, v, out, lse = self._zigzag([grad, q, k, v, out, lse])
        dq, dk, dv = self._call(RING_STEP_BACKWARD, (grad, q, k, v, out, lse, *self._how(0)), [q, k, v], "g0")
        g_s, q_s, o_s, l_s = grad, q, out, lse
        for s in range(1, self.n):
            g_s, q_s, o_s, l_s = (self._permute(x, shift_order(self.n), f"t{s}") for x in (g_s, q_s, o_s, l_s))
            args = (g_s, q_s, k, v, o_s, l_s, *self._how(0, s))
            gq, gk, gv = self._call(RING_STEP_BACKWARD, args, [q, k, v], f"g{s}")
            last = s == self.n - 1
            (dk,) = self._call(_ADD, (dk, gk), [dk], f"g{s}", self._last([dk_r]) if last else None)
            (dv,) = self._call(_ADD, (dv, gv), [dv], f"g{s}", self._last([dv_r]) if last else None)
            back = self._permute(gq, shift_order(self.n, -s), "back")
            (dq,) = self._call(_ADD, (dq, back), [dq], f"g{s}", self._last([dq_r]) if last else None)
        self._home([dq, dk, dv], [dq_r, dk_r, dv_r])
