"""Mixed precision: parameters computed and gathered in a low dtype, gradients reduced in another.

``parallelize(..., precision="bf16")`` asks for what FSDP2's ``MixedPrecisionPolicy`` does, in its
terms (``Precision``): the model is captured with its floating parameters in ``param`` dtype and its
floating inputs cast to it (the capture's forward pre-hook, as FSDP2's ``cast_forward_inputs``), so
every op computes as the single-device model would with its parameters cast; outputs are cast to
``output`` where one is given. The parameters themselves stay in their own dtype (fp32 master
weights, what ``pm.parameters()`` and the optimizer hold), and so do their gradients.

The ``precision`` pass (after boxing, before bucketing) puts the two casts that joins into the
program, where they cost least and the policy asks for them:

* a parameter's cast to ``param`` reads its stored shard, so the all-gather boxing placed after it
  moves ``param``-dtype bytes (half of fp32's for bf16);
* a gradient is cast to ``reduce`` where its computation ends, before the first collective on its
  way to the output (reduce-scatter, all-reduce), which then runs in ``reduce``; and to the
  parameter's own dtype after the last.

The bucket pass then packs those casts into its flat buffers (one copy instead of a cast and a copy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from meshfold.ir import Graph, GraphBuilder, Op, TensorType, Value, dtype_name, is_view
from meshfold.ir.graph import Provenance, remap_op
from meshfold.ir.ops import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER
from meshfold.ir.types import DTYPES_BY_NAME
from meshfold.passes.base import Pass, PassError, key_values
from meshfold.passes.sharding.boxing import BOXED

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext

CAST = torch.ops.aten._to_copy.default
"""The op a cast is in the IR (what a ``.to(dtype)`` captures as)."""
_SPELLINGS = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
SHORTHANDS = {
    "bf16": ("bf16", "fp32"),
    "fp16": ("fp16", "fp32"),
    "bf16-reduce": ("bf16", "bf16"),
}
"""``precision="bf16"``: bf16 parameters for compute and all-gathers, fp32 gradient reduction (torchtitan's
default); ``"bf16-reduce"`` reduces in bf16 too."""
_MOVES = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL)
"""Collectives a gradient may pass through on its way to its output: they run in the reduce dtype."""


def dtype_of(spelling: object, what: str) -> torch.dtype:
    """``"bf16"``, ``"float32"``, ``torch.float16``... as a floating torch dtype; raises ``PassError``."""
    if isinstance(spelling, torch.dtype) and spelling.is_floating_point:
        return spelling
    if isinstance(spelling, str):
        name = spelling.strip().lower().removeprefix("torch.")
        found = _SPELLINGS.get(name) or DTYPES_BY_NAME.get(name)
        if found is not None and found.is_floating_point:
            return found
    raise PassError(f"precision {what}={spelling!r} is not a floating dtype; write bf16, fp16 or fp32")


@dataclass(frozen=True)
class Precision:
    """A mixed-precision policy in FSDP2's terms: ``param`` is the dtype parameters are computed and
    all-gathered in, ``reduce`` the one gradients are reduced in (None: ``param``), ``output`` the one
    the forward's floating outputs are cast to (None: as computed), ``cast_inputs`` whether floating
    inputs are cast to ``param`` before the forward (FSDP2's ``cast_forward_inputs``)."""

    param: torch.dtype
    reduce: torch.dtype | None = None
    output: torch.dtype | None = None
    cast_inputs: bool = True

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.reduce if self.reduce is not None else self.param

    def __str__(self) -> str:
        parts = [f"param={dtype_name(self.param)}", f"reduce={dtype_name(self.reduce_dtype)}"]
        if self.output is not None:
            parts.append(f"output={dtype_name(self.output)}")
        if not self.cast_inputs:
            parts.append("cast_inputs=false")
        return ",".join(parts)

    @staticmethod
    def of(spec: object) -> Precision | None:
        """``"bf16"`` (a shorthand, ``SHORTHANDS``), ``"param=bf16,reduce=fp32,output=fp32"``, a dict
        of those keys, a ``Precision``, or torch's ``MixedPrecisionPolicy``; ``"fp32"``/``None``: no
        policy. Raises ``PassError`` naming what is wrong."""
        if spec is None or isinstance(spec, Precision):
            return spec
        if type(spec).__name__ == "MixedPrecisionPolicy":
            return _of_policy(spec)
        if isinstance(spec, str):
            text = spec.strip().lower()
            if text in ("fp32", "f32", "float32", "none", ""):
                return None
            if text in SHORTHANDS:
                param, reduce = SHORTHANDS[text]
                return Precision(dtype_of(param, "param"), dtype_of(reduce, "reduce"))
            if "=" not in text:
                raise PassError(
                    f"precision {spec!r} is unknown; use {', '.join(SHORTHANDS)}, fp32, or "
                    "param=bf16,reduce=fp32,output=fp32"
                )
            spec = key_values(text, "precision", "param=bf16,reduce=fp32")
        if not isinstance(spec, Mapping):
            raise PassError(f"precision= takes a string, a dict or a MixedPrecisionPolicy, not {type(spec).__name__}")
        known = [f.name for f in fields(Precision)]
        unknown = sorted(set(spec) - set(known))
        if unknown:
            raise PassError(f"precision= takes the keys {', '.join(known)}; unknown: {', '.join(unknown)}")
        if spec.get("param") is None:
            raise PassError("precision= needs a param dtype (e.g. param=bf16), or use the shorthand 'bf16'")
        return Precision(
            dtype_of(spec["param"], "param"),
            None if spec.get("reduce") is None else dtype_of(spec["reduce"], "reduce"),
            None if spec.get("output") is None else dtype_of(spec["output"], "output"),
            bool(spec.get("cast_inputs", True)),
        )


def _of_policy(policy: Any) -> Precision | None:
    """torch's ``MixedPrecisionPolicy`` (FSDP2): the same four fields; no ``param_dtype``, no policy."""
    if policy.param_dtype is None:
        if policy.reduce_dtype is not None or policy.output_dtype is not None:
            raise PassError("a MixedPrecisionPolicy without param_dtype: give param_dtype (e.g. torch.bfloat16)")
        return None
    return Precision(policy.param_dtype, policy.reduce_dtype, policy.output_dtype, bool(policy.cast_forward_inputs))


@dataclass(frozen=True)
class Casts(Pass):
    """Place the precision policy's casts (module docstring): each parameter's to ``param`` on its
    stored shard, once per phase, before the first op that reads it; each gradient's to ``reduce``
    before its first collective and to the parameter's dtype after its last. Without a policy the
    graph is left as it is."""

    name: ClassVar[str] = "precision"
    requires: ClassVar[frozenset[str]] = frozenset({BOXED})
    invalidates: ClassVar[frozenset[str]] = frozenset({"scheduled", "bucketed"})

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        policy = ctx.options.precision
        if policy is None:
            return graph
        b = GraphBuilder(graph.name, graph.mesh)
        b.stacks = graph.stacks
        master: dict[Value, Value] = {}  # NOTE: a parameter as captured (param dtype) -> its master input
        for i in graph.inputs:
            t = i.value.type
            if i.kind == "param" and isinstance(t, TensorType) and t.dtype == policy.param != MASTER:
                master[i.value] = b.add_input("param", i.name, TensorType(t.shape, MASTER), i.value.layout)
            else:
                b.keep_input(i)
        heads, chain = _reductions(graph, policy.reduce_dtype)
        renamed: dict[Value, Value] = {}  # NOTE: a gradient's values on its way out, now in the reduce dtype
        low: dict[tuple[Value, str], Value] = {}  # NOTE: (parameter, phase) -> its cast
        for op in graph.ops:
            local: dict[Value, Value] = {}
            for v in dict.fromkeys(op.operands):
                if v in master:
                    key = (v, op.prov.phase)
                    if key not in low:
                        (low[key],) = b.add_op(
                            CAST, (master[v],), (("dtype", policy.param),), (_typed(v, policy.param),), op.prov
                        )
                    local[v] = low[key]
                elif v in heads.get(op, ()):
                    (local[v],) = b.add_op(
                        CAST, (v,), (("dtype", policy.reduce_dtype),), (_typed(v, policy.reduce_dtype),), op.prov
                    )
            new = remap_op(op, local | renamed)
            if op in chain:
                results = tuple(_typed(r, policy.reduce_dtype, r.name) for r in op.results)
                renamed.update(zip(op.results, results, strict=True))
                new = Op(new.target, new.args, new.kwargs, results, new.prov)
            b.append(new)
        dtypes = {i.name: i.value.type.dtype for i in b.inputs if isinstance(i.value.type, TensorType)}
        for o in graph.outputs:
            v = renamed.get(o.value, o.value)
            want = dtypes.get(o.name) if o.kind == "grad" else None
            if want is not None and isinstance(v.type, TensorType) and v.type.dtype != want:
                prov = Provenance("", "bwd")
                (v,) = b.add_op(CAST, (v,), (("dtype", want),), (_typed(v, want),), prov)
            b.add_output(o.kind, o.name, v)
        return b.build()


MASTER = torch.float32
"""The dtype parameters are kept in (master weights) under a policy; ``parallelize`` refuses a model
with floating parameters in another."""


def _typed(v: Value, dtype: torch.dtype, name: str | None = None) -> Value:
    """A new value like ``v`` (its shape and layout) in ``dtype``."""
    t = v.type
    assert isinstance(t, TensorType)
    return Value(name or f"{v.name}_{dtype_name(dtype)}", TensorType(t.shape, dtype), v.layout)


def _reductions(graph: Graph, reduce: torch.dtype) -> tuple[dict[Op, set[Value]], set[Op]]:
    """Where each gradient is cast to ``reduce``: for each gradient output, the collectives and views
    that carry it from the op that computes it (each read by nothing else) form its way out; when
    that holds a collective and the gradient is not in ``reduce`` already, the first op of it reads a
    cast (``heads``: op -> the values it reads cast) and every op of it (``chain``) computes in
    ``reduce``."""
    produced = graph.producers()
    users = graph.users()
    outputs = [o.value for o in graph.outputs]
    heads: dict[Op, set[Value]] = {}
    chain: set[Op] = set()
    for o in graph.outputs:
        if o.kind != "grad" or not isinstance(o.value.type, TensorType) or o.value.type.dtype == reduce:
            continue
        way: list[Op] = []
        v = o.value
        while v in produced:
            op = produced[v]
            carries = op.target in _MOVES or is_view(op.target)
            if not carries or len(op.results) != 1 or len(set(op.operands)) != 1:
                break
            (x,) = set(op.operands)
            way.append(op)
            v = x
            if len(users.get(x, ())) != 1 or outputs.count(x):
                break
        if not any(op.target in _MOVES for op in way):
            continue
        chain.update(way)
        heads.setdefault(way[-1], set()).add(v)
    return heads, chain
