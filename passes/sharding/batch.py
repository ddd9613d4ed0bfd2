"""The batch under a plan: which values are computed from the user's inputs, and whether each mesh
axis keeps them split (data parallelism) or lets every rank compute the whole batch.

Presets keep the batch split on their ``ddp`` / ``fsdp`` axes (``Problem.batch_axes``); only
``plan="auto"`` may trade that away, and ``batch_splits`` then says where it did. A ``cp`` axis
splits each input's sequence instead (``Problem.sequence_axes``); ``attention_split`` checks that no
attention then reads it whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshfold.ir import Graph, Layout, Mesh, Placement, Shard, TensorType, Value
from meshfold.passes.base import PassError
from meshfold.passes.sharding.ilp.problem import Solution
from meshfold.passes.sharding.rules.attention import RESULT_ROLES


def batch_values(graph: Graph) -> frozenset[Value]:
    """The user's inputs (graph inputs of kind ``input``) and every op result computed from one."""
    out = {i.value for i in graph.inputs if i.kind == "input"}
    for op in graph.ops:
        if not out.isdisjoint(op.operands):
            out.update(op.results)
    return frozenset(out)


@dataclass(frozen=True)
class BatchSplit:
    """How one mesh axis treats the batch in a solved plan. ``split`` / ``whole``: the user's inputs
    sharded / replicated on it; ``gathered``: values computed from them that some op reads whole
    (each rank of the axis then computes that part for the whole batch). Moving a value from one
    shard to another (an all-to-all) keeps the work split and counts as neither."""

    axis: str
    split: tuple[str, ...]
    whole: tuple[str, ...]
    gathered: tuple[str, ...]

    @property
    def data_parallel(self) -> bool:
        """Whether every rank of the axis works on its own part of the batch throughout."""
        return bool(self.split) and not self.whole and not self.gathered

    def describe(self) -> str:
        """One line saying how the axis gave data parallelism up ('' when it did not)."""
        if self.data_parallel:
            return ""
        why = []
        if self.whole:
            one = len(self.whole) == 1
            why.append(f"input{'' if one else 's'} {', '.join(self.whole)} {'is' if one else 'are'} replicated on it")
        if self.gathered:
            shown = ", ".join(self.gathered[:4]) + (" ..." if len(self.gathered) > 4 else "")
            why.append(f"{len(self.gathered)} values computed from the inputs are gathered off their shard ({shown})")
        return (
            f"plan='auto' trades data parallelism away on mesh axis {self.axis!r}: {'; '.join(why)}, so its ranks "
            "compute on the whole batch; use a preset (e.g. 'fsdp+tp') to keep the batch split"
        )


def batch_splits(graph: Graph, mesh: Mesh, solution: Solution, start: Mapping[Value, Layout]) -> tuple[BatchSplit, ...]:
    """Per mesh axis of more than one rank, how ``solution`` treats the batch (see ``BatchSplit``);
    ``start``: the layouts of the inputs the solve did not choose."""
    batch = batch_values(graph)
    users = [i for i in graph.inputs if i.kind == "input" and isinstance(i.value.type, TensorType)]
    source: dict[Value, tuple[int, int]] = {
        r: (o, j) for o, op in enumerate(graph.ops) for j, r in enumerate(op.results)
    }
    # NOTE: the batch tensors each op reads (op, operand index, value, where it is made), found once
    # for every axis
    reads = [
        (o, idx, v, source.get(v))
        for o, op in enumerate(graph.ops)
        for idx, v in enumerate(op.operands)
        if v in batch and isinstance(v.type, TensorType)
    ]
    out = []
    for k, axis in enumerate(mesh.names):
        if mesh.sizes[k] == 1:
            continue

        def placed(v: Value, at: tuple[int, int] | None, k: int = k, axis: str = axis) -> Placement:
            if at is not None:
                return solution.strategies[at[0]][k].outputs[at[1]]
            lay = solution.inputs.get(v) or start.get(v) or Layout.replicated(mesh)
            return lay.placement(axis)

        split = tuple(i.name for i in users if isinstance(placed(i.value, None), Shard))
        whole = tuple(i.name for i in users if not isinstance(placed(i.value, None), Shard))
        gathered: dict[str, None] = {}
        for o, idx, v, at in reads:
            if isinstance(placed(v, at), Shard) and not isinstance(solution.strategies[o][k].inputs[idx], Shard):
                gathered[v.name] = None
        out.append(BatchSplit(axis, split, whole, tuple(gathered)))
    return tuple(out)


def attention_split(graph: Graph, axes: Sequence[str]) -> None:
    """Raise unless, on each context-parallel axis in ``axes``, every attention of the laid-out
    ``graph`` reads its queries split (by sequence, batch or heads), naming the first that reads
    them whole: every rank of the axis would attend over the whole sequence."""
    mesh = graph.mesh
    if mesh is None or not axes:
        return
    for op in graph.ops:
        if op.target not in RESULT_ROLES or op.prov.phase != "fwd":
            continue
        q = op.operands[0]
        for axis in axes:
            if not isinstance(q.layout.placement(axis), Shard):
                raise PassError(
                    f"{op.describe()}: on the context-parallel mesh axis {axis!r} ({mesh.size(axis)} ranks) its "
                    f"queries {q.type} split neither by batch nor by heads, so every rank would attend over the "
                    "whole sequence; use a cp size that divides the batch or the key/value heads, or "
                    "cp={'method': 'ring'} (attention split by sequence)"
                )
