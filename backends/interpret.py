"""Reference interpreter: run an (unsharded) IR graph op by op on real tensors.

It is the ground truth that tests compare captures and later lowerings against; it is not fast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from meshfold import ir
from meshfold.ir import Graph, OpDef, Value, view_trait
from meshfold.ir.dialects.ring import permuted
from meshfold.ir.graph import Arg


class InterpretError(RuntimeError):
    """The graph cannot run as given (a missing input, one of our own ops, a failing op)."""


def interpret(graph: Graph, inputs: Mapping[str, torch.Tensor]) -> dict[tuple[str, str], torch.Tensor]:
    """Run ``graph`` with ``inputs`` by input name; tangents default to ones.

    Returns every output by ``(kind, name)``, e.g. ``("out", "0")`` or ``("grad", "l1.weight")``.
    """
    env = run_values(graph, inputs)
    return {(o.kind, o.name): env[o.value] for o in graph.outputs}


def run_values(graph: Graph, inputs: Mapping[str, torch.Tensor], *, global_view: bool = False) -> dict[Value, Any]:
    """Run ``graph`` and return the runtime value of every input and op result.

    ``global_view``: run a sharded graph on whole (global) tensors. IR types are global, so every
    op that keeps its value (``OpDef.keeps_value``: the ``comm.*`` ops change layouts only) is the
    identity there, and ``comm.ppermute`` moves the pieces of its dim (``ir.dialects.ring.permuted``).
    """
    env: dict[Value, Any] = {}
    for i in graph.inputs:
        if i.name in inputs:
            env[i.value] = inputs[i.name]
        elif i.kind == "tangent" and isinstance(i.value.type, ir.TensorType):
            t = i.value.type
            env[i.value] = torch.ones(tuple(int(d) for d in t.shape), dtype=t.dtype)
        else:
            raise InterpretError(f"graph @{graph.name} needs input %{i.name} ({i.kind}), which was not given")
    with torch.no_grad():
        for op in graph.ops:
            if isinstance(op.target, OpDef):
                if global_view and op.target == ir.ops.PPERMUTE:  # NOTE: pieces of a split dim moved
                    x = env[op.operands[0]]
                    env[op.result] = permuted(x, int(op.kwarg("dim")), op.kwarg("order"))  # type: ignore[arg-type]
                    continue
                if global_view and op.target.keeps_value:
                    for r, x in zip(op.results, op.operands, strict=True):
                        env[r] = env[x]
                    continue
                raise InterpretError(f"{op.describe()}: {op.name} needs a mesh; lower the graph with a backend")
            args = [_load(a, env) for a in op.args]
            kwargs = {k: _load(v, env) for k, v in op.kwargs}
            try:
                out = runnable_target(op.target)(*args, **kwargs)
            except Exception as e:
                raise InterpretError(f"{op.describe()} failed: {e}") from e
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if len(outs) != len(op.results):
                raise InterpretError(f"{op.describe()} returned {len(outs)} values for {len(op.results)} results")
            env.update(zip(op.results, outs, strict=True))
    return env


def runnable_target(target: Any) -> Any:
    """What runs ``target`` on real tensors: a strided view (``ir.view_trait``: ``aten.view``,
    ``aten._unsafe_view``) as ``aten.reshape``.

    NOTE: a view valid on the strides seen while tracing may not be on the real tensor (a local
    shard, or an op whose real output strides differ from its fake ones, such as the cat of
    transposed gradients); the graph is functional, so reshape computes the same value and copies
    only when it must."""
    trait = view_trait(target)
    return torch.ops.aten.reshape.default if trait is not None and trait.strided else target


def _load(a: Arg, env: dict[Value, Any]) -> Any:
    if isinstance(a, Value):
        return env[a]
    if isinstance(a, tuple):
        return [_load(x, env) for x in a]
    return a
