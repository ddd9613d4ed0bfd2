"""Peak memory of one rank, from liveness over its scheduled SPMD graph.

The graph after ``boxing`` (and ``bucket``) is what every rank runs: forward ops in graph order,
then backward ops. This analysis walks that schedule with each value's *local* size (its global
type divided over the mesh axes that shard it) and mirrors how the program is executed:

* parameters and buffers are resident, and so is the optimizer state (``optimizer_states`` copies of
  every trainable parameter: 2 for Adam);
* an op's results are allocated when it runs; a view (``ir.is_view``: its result shares its first
  operand's storage) allocates nothing and keeps its base alive;
* a value is freed after its last use in its own phase; a forward value the backward reads is
  saved: it lives until the backward finishes (the autograd context holds it); gradients live from
  the op that produces them to the end of the step (they become ``.grad``);
* ``mem.offload``'s result is in the host tier (0 bytes here): the value it copies is freed after its
  last forward use, and ``mem.reload`` allocates it again in the backward;
* collectives also hold their staging buffers while they run (the contiguous copy of a non-leading
  dim, the gathered or flat bucket buffer), as the eager lowering lays them out;
* a started collective (``ir.asynchrony``) allocates its results at its start, and they are its
  wait's results (the same storage); its operands and its staging copy stay alive until the wait
  (the collective reads them while on the wire);
* on gloo (CPU ranks: ``cluster`` None, the default, or the catalog's host device) the lowering
  sends an all-gather as an all-to-all of its operand repeated once per rank, so it holds twice
  its output at its end (NCCL writes the output directly; without this, offloaded programs on 4
  CPU ranks measured up to 38% over), and a sum reduce-scatter as an all-to-all of its operand,
  whose every block arrives before they are summed: it holds its whole operand again. An
  all-to-all whose concat and split dims are one is lowered as a gather of every rank's operand,
  then this rank's chunk: gloo's flat buffer is that whole gather.

* a routed-experts op (``ir.dialects.moe``) also holds its working set while it runs
(``ir.dialects.moe_memory.working_set``:
  its pairs' indices and one piece of one expert's temporaries); other kernels' internal
  workspaces are not modelled.

The peak is over forward and backward; the optimizer step's own temporaries come after it. Imports
``ir`` (and hence torch), so ``passes.cost`` does not re-export it: the planner stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.ir import Graph, Mesh, Op, OpDef, Value, is_view
from meshfold.ir.asynchrony import starts
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.ir.dialects.moe_memory import working_set
from meshfold.ir.graph import local_nbytes
from meshfold.ir.ops import (
    ALL_GATHER,
    ALL_GATHER_BUCKET,
    ALL_REDUCE,
    ALL_REDUCE_BUCKET,
    ALL_TO_ALL,
    OFFLOAD,
    PPERMUTE,
    REDUCE_SCATTER,
    REDUCE_SCATTER_BUCKET,
    WAIT,
)
from meshfold.target.hardware import LOCAL, Cluster


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """One rank's memory over a training step's forward and backward (bytes)."""

    params: int
    buffers: int
    optimizer: int
    peak_transient: int
    """Activations, saved values, gradients so far and comm buffers at the peak."""
    peak_at: str
    """The op running at the peak."""
    timeline: tuple[tuple[str, int], ...]
    """(op, transient bytes live while it runs), in schedule order."""

    @property
    def resident(self) -> int:
        return self.params + self.buffers + self.optimizer

    @property
    def peak(self) -> int:
        return self.resident + self.peak_transient


def rank_memory(graph: Graph, optimizer_states: int = 2, *, cluster: Cluster | None = None) -> MemoryEstimate:
    """Liveness of ``graph`` (an SPMD graph after boxing) on one rank of ``cluster`` (None: gloo ranks
    on this CPU, as everywhere); see the module docstring."""
    gloo = cluster is None or cluster.device.name == LOCAL
    if graph.mesh is None:
        raise ValueError("memory liveness needs a graph with a mesh (run the sharding pass first)")
    mesh = graph.mesh
    size = {v: local_nbytes(v, mesh) for v in _values(graph)}
    for op in graph.ops:  # NOTE: an offloaded copy lives in the host tier, not in this memory
        if op.target == OFFLOAD:
            size.update((r, 0) for r in op.results)
    params = sum(size[i.value] for i in graph.inputs if i.kind == "param")
    buffers = sum(size[i.value] for i in graph.inputs if i.kind == "buffer")
    trainable = {o.name for o in graph.outputs if o.kind == "grad"}
    optimizer = optimizer_states * sum(size[i.value] for i in graph.inputs if i.kind == "param" and i.name in trainable)

    schedule = [op for op in graph.ops if op.prov.phase == "fwd"] + [op for op in graph.ops if op.prov.phase != "fwd"]
    waits = starts(graph)
    root = _alias_roots(graph, schedule)
    resident = {root[i.value] for i in graph.inputs if i.kind in ("param", "buffer")}
    end = _last_uses(graph, schedule, root, waits)
    staged = {s: _staging(s, size, mesh, gloo) for s in waits.values()}

    live = sum(size[i.value] for i in graph.inputs if i.kind not in ("param", "buffer") and i.kind != "tangent")
    tangents_at = next((k for k, op in enumerate(schedule) if op.prov.phase != "fwd"), len(schedule))
    timeline: list[tuple[str, int]] = []
    peak, peak_at = live, "start"
    for k, op in enumerate(schedule):
        if k == tangents_at:
            live += sum(size[i.value] for i in graph.inputs if i.kind == "tangent")
        new = {root[r] for r in op.results if root[r] is r and r not in resident}
        # NOTE: a wait also ends its start's operands that the call was handed as they are
        used = (*op.operands, *(_handed(waits[op], mesh) if op in waits else ()))
        dying = {root[u] for u in used} - resident - new
        dying = {r for r in dying if end.get(r) == k}
        made, freed = sum(size[r] for r in new), sum(size[r] for r in dying)
        stages = _stages(op, size, mesh, gloo) or ((made, True),)
        during = max(live + extra - (0 if inputs_alive else freed) for extra, inputs_alive in stages)
        timeline.append((op.describe(), during))
        if during > peak:
            peak, peak_at = during, op.describe()
        live += made - freed - sum(size[r] for r in new if end.get(r) == k)
        if op in staged:
            live += staged[op]
        if op in waits:
            live -= staged[waits[op]]
    return MemoryEstimate(params, buffers, optimizer, peak, peak_at, tuple(timeline))


def _values(graph: Graph) -> list[Value]:
    return [i.value for i in graph.inputs] + [r for op in graph.ops for r in op.results]


def alias_roots(graph: Graph) -> dict[Value, Value]:
    """Each value's storage owner: itself, or (through views) the value whose buffer it shares."""
    return _alias_roots(
        graph, [op for op in graph.ops if op.prov.phase == "fwd"] + [op for op in graph.ops if op.prov.phase != "fwd"]
    )


def _alias_roots(graph: Graph, schedule: list[Op]) -> dict[Value, Value]:
    root = {i.value: i.value for i in graph.inputs}
    for op in schedule:
        if op.target == WAIT:  # NOTE: a wait's results are its start's buffers
            root.update((r, root[h]) for r, h in zip(op.results, op.operands, strict=True))
            continue
        base = root[op.operands[0]] if op.operands and is_view(op.target) else None
        for r in op.results:
            root[r] = base if base is not None else r
    return root


def _last_uses(graph: Graph, schedule: list[Op], root: dict[Value, Value], waits: dict[Op, Op]) -> dict[Value, int]:
    """Schedule index after which each storage can be freed (fx frees a value after its last use;
    saved forward values, gradients and outputs live to the end of the step; a started collective's
    operands, to its wait)."""
    last_index = len(schedule) - 1
    end: dict[Value, int] = {}
    produced_in = {r: op.prov.phase == "fwd" for op in schedule for r in op.results}
    produced_in |= {i.value: i.kind != "tangent" for i in graph.inputs}
    for k, op in enumerate(schedule):
        for r in op.results:
            end.setdefault(root[r], k)  # NOTE: an unused result is freed right after its op
        for u in (*op.operands, *(_handed(waits[op], graph.mesh) if op in waits and graph.mesh else ())):
            saved = op.prov.phase != "fwd" and produced_in[u]
            end[root[u]] = last_index if saved else max(end.get(root[u], k), k)
    for o in graph.outputs:
        end[root[o.value]] = last_index
    return end


def _handed(op: Op, mesh: Mesh) -> tuple[Value, ...]:
    """The operands a started collective's lowering hands to the call as they are (no copy first):
    a gather, reduce-scatter or all-to-all of a leading dim, a ppermute of one piece per rank. An
    all-reduce works on its own copy."""
    if op.target == PPERMUTE:
        return op.operands if _one_piece(op, mesh) else ()
    if op.target in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL) and op.kwarg("reduce") != "max":
        dim = op.kwarg("concat_dim", op.kwarg("dim", 0))
        return op.operands if dim == 0 else ()
    return ()


def _staging(op: Op, size: dict[Value, int], mesh: Mesh, gloo: bool) -> int:
    """Bytes a started collective's lowering copies its operands into (a flat bucket buffer, the
    contiguous copy of a non-leading dim; gloo's flat gather buffer), alive until its wait."""
    if op.target in (ALL_GATHER_BUCKET, REDUCE_SCATTER_BUCKET):
        return sum(size[u] for u in op.operands) + (_flat(op, size, mesh) if gloo else 0)
    if op.target == PPERMUTE and _one_piece(op, mesh):
        return 0
    dim = op.kwarg("concat_dim", op.kwarg("dim", 0))
    flat = _flat(op, size, mesh) if gloo else 0
    return flat + (sum(size[u] for u in op.operands) if isinstance(dim, int) and dim else 0)


def _one_piece(op: Op, mesh: Mesh) -> bool:
    """A ``comm.ppermute`` that moves each rank's part whole (its lowering hands it over as it lies)."""
    order = op.kwarg("order")
    assert isinstance(order, (tuple, list))
    return len(order) == mesh.size(str(op.kwarg("axis")))


def _flat(op: Op, size: dict[Value, int], mesh: Mesh) -> int:
    """What the gloo lowering of a collective holds beyond its operands, its staging copies and its
    results while on the wire: an all-gather's operand repeated once per rank (its bucket's flat
    buffer repeated), a sum reduce-scatter's blocks from every rank but the one its result takes
    the place of, the gather of an all-to-all whose concat and split dims are one (every rank's
    operand). 0 for others."""
    src, out = sum(size[u] for u in op.operands), sum(size[r] for r in op.results)
    if op.target in (ALL_GATHER, ALL_GATHER_BUCKET) and op.kwarg("reduce") != "max":
        return out
    if op.target in (REDUCE_SCATTER, REDUCE_SCATTER_BUCKET) and op.kwarg("reduce") != "max":
        return src - out
    if op.target == ALL_TO_ALL and op.kwarg("concat_dim") == op.kwarg("split_dim"):
        return mesh.size(str(op.kwarg("axis"))) * src
    return 0


def _stages(op: Op, size: dict[Value, int], mesh: Mesh, gloo: bool) -> tuple[tuple[int, bool], ...]:
    """How a collective's eager lowering allocates, as steps of (bytes it holds beyond what was live
    before it, whether its operands are still alive then): the contiguous copy of a non-leading dim,
    the gathered or flat buffers, then the results. Empty for ops that just make their results."""
    if op.target in (EXPERTS, EXPERTS_BACKWARD):
        return ((sum(size[r] for r in op.results) + working_set(op, mesh), True),)
    if not isinstance(op.target, OpDef) or not op.operands:
        return ()
    axis = op.kwarg("axis")
    if axis is None or mesh.size(str(axis)) == 1:
        return ()
    n = mesh.size(str(axis))
    src, out = sum(size[u] for u in op.operands), sum(size[r] for r in op.results)
    avg = op.kwarg("reduce") == "avg"
    if op.target in (ALL_GATHER, REDUCE_SCATTER):
        if op.kwarg("reduce") == "max":  # NOTE: an all-reduce of the whole value, then this rank's chunk
            return ((src, True), (src + out, False))
        if gloo and op.target == REDUCE_SCATTER:
            # NOTE: every block arrives (the operand's size) while what was sent is held, then their
            # sum; a copy with the dim in front first, moved back after
            if int(op.kwarg("dim")):  # type: ignore[arg-type]
                return ((src, True), (2 * src, False), (src + out, False), (2 * out, False))
            return ((src, True), (src + out, False), *(((2 * out, False),) if avg else ()))
        if int(op.kwarg("dim")):  # type: ignore[arg-type]
            return ((src, True), (src + out, False), (2 * out, False))
        if gloo and op.target == ALL_GATHER:
            return ((out, True), (out + _flat(op, size, mesh), True))
        return ((out, True), (2 * out, False)) if avg else ((out, True),)
    if op.target == ALL_REDUCE:
        return ((out, True), (2 * out, False)) if avg else ((out, True),)
    if op.target == ALL_REDUCE_BUCKET:  # NOTE: the flat buffer, the all-reduce's copy, (avg) the quotient
        return ((src, True), (2 * src, False), *(((2 * out, False),) if avg else ()))
    if op.target == ALL_TO_ALL:
        concat, split = int(op.kwarg("concat_dim")), int(op.kwarg("split_dim"))  # type: ignore[arg-type]
        if concat != split:
            # NOTE: the split dim's copy in front, what arrives beside it, the blocks laid side by
            # side, and (split dim not leading) moved back
            return ((src, True), (2 * src, False), (src + out, False), *(((2 * out, False),) if split else ()))
        full, flat = src * n, _flat(op, size, mesh) if gloo else 0  # NOTE: a gather, then this rank's chunk
        if concat:
            return ((src, True), (src + full + flat, False), (2 * full, False), (full + out, False))
        return ((full, True), (full + flat, True), (full + out, False))
    if op.target not in (ALL_GATHER_BUCKET, REDUCE_SCATTER_BUCKET):
        return ()  # NOTE: comm.shard / comm.partial make their result directly
    given = op.kwarg("dims")
    assert isinstance(given, tuple | list)
    dims = [int(d) for d in given]
    moved = sum(size[u] for u, d in zip(op.operands, dims, strict=True) if d)
    if op.target == ALL_GATHER_BUCKET:
        sent = n * src if gloo else 0  # NOTE: the flat buffer repeated once per rank
        return ((moved + src, True), (src + sent + n * src, False), (n * src + out, False))
    mine = src // n
    if gloo:  # NOTE: every rank's blocks arrive beside the flat buffer (held to the wait), then their sum
        summed = ((2 * src, False), (src + mine, False))
        return ((moved + src, True), *summed, (2 * mine * avg, False), (mine + out, False))
    return ((moved + src, True), (src + mine, False), (2 * mine * avg, False), (mine + out, False))


def size_text(n: float) -> str:
    """``n`` bytes for a message: ``812 B``, ``48.5 KiB``, ``6.0 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
