"""Writing a chain of ops as IR text: :class:`Builder` runs every op on meta tensors for its result
types, so a chain is well typed by construction; :class:`Chain` is one picklable example;
:func:`joint_text` captures a chain's forward and backward as one joint graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

from meshfold import ir
from meshfold.ir import resolve_target, tensor_type

MESH_HEADER = "graph @chain mesh<dp=2, tp=2> {"
MAX_PARAMS = 4
SIZES = (4, 8, 16)
# NOTE: a result whose typical magnitude may exceed this is divided by a power of two (exact in fp32),
# so values stay O(1) and fp32 rounding (which differs between sharded and whole computation) stays
# far below the test's tolerance however many products and sums the chain stacks.
RESCALE_ABOVE = 4.0


@dataclass(frozen=True)
class Chain:
    """One example: the unsharded graph's text, each param's ``{axis: placement}`` and a data seed."""

    text: str
    layouts: dict[str, dict[str, str]]
    seed: int

    def __str__(self) -> str:
        plan = ", ".join(f"{n}: dp={a['dp']} tp={a['tp']}" for n, a in self.layouts.items())
        return f"{self.text}// layouts: {plan}\n// seed: {self.seed}\n"


@dataclass(frozen=True)
class Ref:
    """A value of the chain under construction: its name, a meta tensor of its type, the typical
    magnitude of its elements, and whether every element is known to be positive."""

    name: str
    meta: torch.Tensor
    mag: float
    pos: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.meta.shape)

    @property
    def rank(self) -> int:
        return self.meta.dim()


@dataclass
class Builder:
    """Writes the chain's IR lines; every op is run on meta tensors to get its result types."""

    params: list[Ref] = field(default_factory=list)
    values: list[Ref] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def param(self, shape: tuple[int, ...]) -> Ref:
        ref = Ref(f"p{len(self.params)}", torch.empty(shape, device="meta"), 1.0)
        self.params.append(ref)
        self.values.append(ref)
        return ref

    def room(self) -> bool:
        return len(self.params) < MAX_PARAMS

    def op(
        self, target: str, args: tuple[Any, ...], mag: float, *, pos: bool = False, kwargs: Mapping[str, Any] = {}
    ) -> Ref:
        """Append ``%vN = target(args)`` (one result) and return it."""
        (ref,) = self.ops(target, args, mag, pos=pos, kwargs=kwargs, n=1)
        return ref

    def ops(
        self,
        target: str,
        args: tuple[Any, ...],
        mag: float,
        *,
        pos: bool = False,
        kwargs: Mapping[str, Any] = {},
        n: int,
    ) -> list[Ref]:
        """Append an op with ``n`` results; a float result larger than :data:`RESCALE_ABOVE` comes
        back divided down (only the first result of a multi-result op is rescaled)."""
        out = resolve_target(target)(*(_meta(a) for a in args), **{k: _meta(v) for k, v in kwargs.items()})
        metas = [m.to("meta") for m in (out if isinstance(out, (tuple, list)) else [out])]
        assert len(metas) == n, f"{target} gave {len(metas)} results, expected {n}"
        base = len(self.lines) + 1
        refs = [Ref(f"v{base}" + (f"_{i}" if n > 1 else ""), m, mag, pos) for i, m in enumerate(metas)]
        # NOTE: only f32 values are offered as operands later (masks, indices and the f64 values of
        # a cast round trip are used once, by the op that made them).
        self.values.extend(r for r in refs if r.meta.dtype == torch.float32)
        call = ", ".join([*(_text(a) for a in args), *(f"{k}={_text(v)}" for k, v in kwargs.items())])
        lhs = ", ".join(f"%{r.name}" for r in refs)
        self.lines.append(f"  {lhs} = {target}({call}) : {', '.join(str(tensor_type(m)) for m in metas)}")
        first = refs[0]
        if mag > RESCALE_ABOVE and first.meta.dtype.is_floating_point:
            refs[0] = self.op("aten.div.Scalar", (first, float(2 ** math.ceil(math.log2(mag)))), 1.0, pos=pos)
        return refs

    def text(self, out: Ref) -> str:
        head = [MESH_HEADER, *(f"  param %{p.name} : {tensor_type(p.meta)}" for p in self.params)]
        return "\n".join([*head, *self.lines, f"  output out(0) = %{out.name}", "}"]) + "\n"


def _meta(a: Any) -> Any:
    if isinstance(a, Ref):
        return a.meta
    if isinstance(a, (tuple, list)):
        return [_meta(x) for x in a]
    return a


def _text(a: Any) -> str:
    if isinstance(a, Ref):
        return "%" + a.name
    if isinstance(a, (tuple, list)):
        return "[" + ", ".join(_text(x) for x in a) + "]"
    return repr(a) if isinstance(a, float) else str(a)


Template = tuple[str, Any]


class ChainModule(nn.Module):
    """A module whose parameters are a chain's params and whose forward replays the chain's ops
    (calling the same ATen overloads), so capturing it gives the chain's joint fwd+bwd graph."""

    def __init__(self, graph: ir.Graph) -> None:
        super().__init__()
        index: dict[ir.Value, int] = {}
        for i in graph.inputs:
            t = i.value.type
            assert isinstance(t, ir.TensorType) and i.kind == "param", f"chain input %{i.name} must be a tensor param"
            self.register_parameter(i.name, nn.Parameter(torch.zeros(tuple(int(d) for d in t.shape))))
            index[i.value] = len(index)
        self.names = [i.name for i in graph.inputs]
        self.program: list[tuple[Any, tuple[Template, ...], tuple[tuple[str, Template], ...], int]] = []
        for op in graph.ops:
            args = tuple(_template(a, index) for a in op.args)
            kwargs = tuple((k, _template(v, index)) for k, v in op.kwargs)
            self.program.append((op.target, args, kwargs, len(op.results)))
            for r in op.results:
                index[r] = len(index)
        (out,) = graph.outputs
        self.out = index[out.value]

    def forward(self) -> torch.Tensor:
        env: list[Any] = [getattr(self, n) for n in self.names]
        for target, args, kwargs, n in self.program:
            result = target(*(_load(a, env) for a in args), **{k: _load(v, env) for k, v in kwargs})
            env.extend(result if n > 1 else [result])
        out: torch.Tensor = env[self.out]
        return out


def _template(a: ir.Arg, index: dict[ir.Value, int]) -> Template:
    if isinstance(a, ir.Value):
        return ("value", index[a])
    if isinstance(a, tuple):
        return ("list", tuple(_template(x, index) for x in a))
    return ("const", a)


def _load(t: Template, env: list[Any]) -> Any:
    kind, x = t
    if kind == "value":
        return env[x]
    if kind == "list":
        return [_load(y, env) for y in x]
    return x


def joint_text(chain: Chain) -> str:
    """The captured joint forward+backward graph of ``chain`` (as a :class:`ChainModule`), as text."""
    from meshfold.tracing.tracer import capture

    graph = capture(ChainModule(ir.parse(chain.text)), [], name="chain")
    return str(graph)


Draw = st.DrawFn
OpMaker = Callable[[Draw, "Builder", Ref], Ref]
"""Appends one op family's op(s) taking the head ``Ref`` to the builder; returns the new head."""


def _broadcasts_into(shape: tuple[int, ...], into: tuple[int, ...]) -> bool:
    """``shape`` broadcasts to ``into`` without changing it."""
    if len(shape) > len(into):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(into), strict=False))


def partner(draw: Draw, b: Builder, head: Ref, *, fresh: bool = False) -> Ref:
    """A second operand for an elementwise op with ``head``: a fresh param of a compatible shape
    (always when ``fresh``), the head itself, or an earlier value that broadcasts with the head."""
    known = [
        v
        for v in b.values
        if v is not head and (_broadcasts_into(v.shape, head.shape) or _broadcasts_into(head.shape, v.shape))
    ]
    choices = [*(["fresh"] if b.room() else []), "self", *(["known"] if known else [])]
    how = "fresh" if fresh else draw(st.sampled_from(choices))
    if how == "known":
        return draw(st.sampled_from(known))
    if how == "self":
        return head
    shape = list(head.shape)
    form = draw(st.sampled_from(["same", "suffix", "ones", "bigger"]))
    if form == "suffix" and shape:
        shape = shape[draw(st.integers(1, len(shape))) :]
    elif form == "ones" and shape:
        shape = [1 if draw(st.booleans()) else s for s in shape]
    elif form == "bigger" and len(shape) < 3:
        shape = [draw(st.sampled_from(SIZES)), *shape]
    return b.param(tuple(shape))


def any_dim(draw: Draw, x: Ref) -> int:
    """A dim of ``x``, as often negative as not."""
    d = draw(st.integers(0, x.rank - 1))
    return d - x.rank if draw(st.booleans()) else d


def some_dims(draw: Draw, x: Ref) -> list[int]:
    """A non-empty sorted set of dims of ``x``."""
    return sorted(draw(st.sets(st.integers(0, x.rank - 1), min_size=1, max_size=x.rank)))
