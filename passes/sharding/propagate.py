"""``sharding``: give every value a layout, starting from plan seeds, by a greedy min-cost rule choice.

For each op in program order and each mesh axis independently, among the strategies its rule
allows (that the axis divides), pick the one whose operand placements are cheapest to reach from
the operands' current placements. Where a chosen operand placement differs from the value's
layout, a ``comm.redistribute`` op makes the change explicit (``boxing`` lowers it to collectives).
Graph outputs get their required layouts the same way: the loss Replicate, each gradient the
layout its parameter is stored in.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from meshfold.ir import (
    Graph,
    GraphBuilder,
    Layout,
    Mesh,
    Op,
    Placement,
    Provenance,
    TensorType,
    Value,
    is_view,
)
from meshfold.ir.memo import Kept, by_identity
from meshfold.ir.ops import REDISTRIBUTE, Target
from meshfold.passes import cp
from meshfold.passes.base import JOINT, Pass, PassError
from meshfold.passes.blocks import mirrors, op_kinds
from meshfold.passes.cost.axis import AxisModel, axis_models
from meshfold.passes.moe.spec import plan_with_experts
from meshfold.passes.sharding.batch import attention_split, batch_splits
from meshfold.passes.sharding.cost import nbytes, own_traffic
from meshfold.passes.sharding.ilp.fit import fitted, spill_prices
from meshfold.passes.sharding.ilp.solve import Problem, Solution, preset_plan, report, seeded
from meshfold.passes.sharding.plans import (
    AUTO,
    Plan,
    Seeds,
    effective_plan,
    mesh_presets,
    resolve,
    sequence_axes,
)
from meshfold.passes.sharding.rebind import rebind
from meshfold.passes.sharding.rules import RuleTable, rule_table, strategies_for
from meshfold.passes.sharding.strategy import Strategy, fits_axis, keeps_pinned

if TYPE_CHECKING:
    from meshfold.passes.context import PassContext
    from meshfold.passes.precision import Precision

SHARDED = "sharded"

# NOTE: moving a weight in the forward is paid three times over (gathered again for the backward,
# and its gradient reduced back), so its redistribution cost counts triple; activations once.
PARAM_WEIGHT = 3.0


@dataclass(frozen=True)
class Sharding(Pass):
    """Assign layouts from the context's plan (None: the preset the mesh's axis names imply), with the
    expert weights laid out by the context's expert mapping (applied to the ops by ``moe-fold``).
    Without a mesh the graph runs on one device and is returned unchanged."""

    name: ClassVar[str] = "sharding"
    requires: ClassVar[frozenset[str]] = frozenset({JOINT})
    ensures: ClassVar[frozenset[str]] = frozenset({SHARDED})
    mode: Literal["solve", "greedy"] = "solve"
    """``solve``: one integer program per mesh axis over the whole graph (``solve.py``); ``greedy``:
    the cheapest strategy per op in program order, seeing only its operands."""
    node_limit: int = 20000
    """Branch-and-bound nodes the solve may explore per mesh axis before it settles for the best
    plan found (with a warning giving the gap); with none found by then, a preset plan falls back to
    the greedy choice (with a warning). A unit of work, not time: the plan never depends on load."""
    share_blocks: bool = True
    """Repeated blocks (``layers.1``... mirroring ``layers.0``) share the solve's variables."""
    spill: bool = True
    """Under a memory bound (``parallelize(memory=...)``), the solve may leave activations over it
    for the memory pass to recompute or offload, at that pass's price per byte
    (``memory.budget.spill_prices``), where that costs less time than layouts that fit; off: only
    layouts that fit the bound alone (the memory pass then runs only if none do)."""

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        mesh = ctx.mesh
        if mesh is None:
            return graph
        plan = effective_plan(ctx.options.plan, mesh)
        if ctx.options.moe is not None:
            plan = plan_with_experts(plan, ctx.options.moe, graph, mesh)
        auto = plan.preset == AUTO
        if auto and self.mode != "solve":
            raise PassError("plan='auto' needs sharding{mode=solve}: the greedy choice cannot pick layouts")
        seeds = Seeds() if auto else resolve(plan, graph, mesh)
        for line in seeds.unsplit:
            ctx.warn(line)
        if seeds.whole:
            ways = math.prod(mesh.size(a) for a in seeds.whole)
            ctx.warn(
                f"the batch does not divide over the ranks of data-parallel axes {list(seeds.whole)} of {mesh}: each "
                f"of them computes the whole of its part of it ({ways} times the work of a split batch), equal to one "
                "device; a batch their ranks divide splits again"
            )
        bound = ctx.options.memory if self.mode == "solve" else None
        return fitted(ctx, bound, lambda c, memory: self._laid_out(c, graph, plan, seeds, memory))

    def _laid_out(self, ctx: PassContext, graph: Graph, plan: Plan, seeds: Seeds, memory: int | None) -> Graph:
        """``graph`` per rank under ``plan``, the solve's memory row bounded by ``memory``."""
        mesh = ctx.mesh
        assert mesh is not None
        auto = plan.preset == AUTO
        prop = _Propagator(graph, mesh, seeds, rule_table(), ctx)
        prop.pinned = {i.value: seeds.compute[i.name] for i in graph.inputs if i.name in plan.pinned}
        cp.check(graph, sequence_axes(seeds.roles), cp.method_of(ctx), {a: mesh.size(a) for a in mesh.names})
        if self.mode == "solve":
            try:
                prop.seeds = _solved(graph, mesh, seeds, prop, ctx, auto, self, memory)
            except PassError as e:
                if auto:
                    raise
                ctx.warn(f"{e}; layouts fall back to the greedy choice")
                prop.decided = None
        out = prop.run()
        attention_split(out, sequence_axes(seeds.roles))
        ctx.stats["cp.attention"] = cp.describe(out, sequence_axes(seeds.roles), cp.method_of(ctx))
        return out


def _solved(
    graph: Graph,
    mesh: Mesh,
    seeds: Seeds,
    prop: _Propagator,
    ctx: PassContext,
    auto: bool,
    opts: Sharding,
    bound: int | None,
) -> Seeds:
    """Every op's strategy per axis from the integer program (and, with ``auto``, every parameter's
    and input's layout); returns the seeds to build with."""
    known: dict[int, list[Strategy]] = {}
    candidates = []
    keys = op_kinds(graph)
    mirrored = mirrors(graph, keys) if opts.share_blocks else None
    for op, key in zip(graph.ops, keys, strict=True):  # NOTE: a mirrored layer's op has the same strategies
        if key not in known:
            known[key] = prop.candidates(op)
        candidates.append(known[key])
    if prop.pinned:  # NOTE: which strategies fit an op reads its pinned operands' layouts too
        pins: dict[Hashable, int] = {}
        keyed = zip(keys, graph.ops, strict=True)
        keys = [pins.setdefault((k, *map(prop.pinned.get, op.operands)), len(pins)) for k, op in keyed]
    free = frozenset(i.value for i in graph.inputs if auto and i.kind in ("param", "input"))
    by_name = {i.name: i.value for i in graph.inputs}
    start = {
        i.value: seeds.compute.get(i.name, seeds.storage.get(i.name, Layout.replicated(mesh))) for i in graph.inputs
    }
    wants: dict[int, Layout | Value] = {}
    for k, o in enumerate(graph.outputs):
        if o.kind == "grad" and by_name.get(o.name) in free:
            wants[k] = by_name[o.name]
            continue
        want = seeds.storage.get(o.name) if o.kind in ("grad", "update") else None
        wants[k] = want if want is not None else Layout.replicated(mesh)

    def valid(op: Op, s: Strategy, earlier: list[Strategy]) -> bool:
        return fits_axis(s, list(op.operands), op.results, mesh, earlier) and keeps_pinned(
            s, op.operands, prop.pinned, earlier
        )

    cluster = ctx.options.cluster
    memory = bound if bound is not None else (cluster.device.hbm_bytes if cluster is not None else None)
    models = axis_models(mesh, cluster)
    spill = spill_prices(graph, mesh, cluster) if ctx.options.memory is not None and opts.spill else ()
    problem = Problem(graph, mesh, candidates, start, free, wants, models, valid, memory, spill)
    batch_axes = seeds.batch_axes()
    problem = replace(
        problem,
        node_limit=opts.node_limit,
        status=ctx.status,
        share_blocks=opts.share_blocks,
        batch_axes=batch_axes,
        sequence_axes=frozenset(sequence_axes(seeds.roles)),
        cp_method=cp.method_of(ctx),
        keys=keys,
        mirrored=mirrored,
    )
    travels, states = precision_weights(graph, ctx.options.precision)
    problem = replace(problem, travels=travels, states=states)
    presets = mesh_presets(mesh) if auto and not prop.pinned else []  # NOTE: presets lay out no expert weights
    preset = preset_plan(graph, mesh, problem, presets[0]) if presets else None
    try:
        solution = seeded(problem, preset)
    except PassError:
        if problem.memory is None:
            raise
        # NOTE: no layouts alone keep every activation under the bound: solve for time and leave the
        # bound to the memory pass, which recomputes activations to meet it (or says it cannot)
        ctx.diagnostics.append(
            f"sharding: no layouts keep every activation under the memory bound of {problem.memory} bytes per "
            "device; solved for time, the memory pass recomputes activations to meet the bound"
        )
        problem = replace(problem, memory=None)
        preset = preset_plan(graph, mesh, problem, presets[0]) if presets else None
        solution = seeded(problem, preset)
    if preset is not None:
        ctx.stats["sharding.preset"] = (preset[0], preset[1].step_time)
    priced: list[tuple[str, Solution]] = [preset] if preset is not None else []
    if not solution.optimal and len(presets) > 1:
        # NOTE: a search stopped by its node limit is only known to beat the plan it started from; the
        # mesh's other presets are priced too, so ``auto`` is never worse than any of them
        priced += [p for p in (preset_plan(graph, mesh, problem, n) for n in presets[1:]) if p is not None]
        ctx.stats["sharding.presets"] = {name: plan.step_time for name, plan in priced}
    best = min(priced, key=lambda p: p[1].step_time, default=None)
    if best is not None and best[1].step_time < solution.step_time:
        ctx.warn(
            f"plan 'auto': the {best[0]} preset's layouts model faster ({best[1].step_time * 1e3:.3f} ms per "
            f"step against {solution.step_time * 1e3:.3f} ms for the solved ones); using them"
        )
        solution = best[1]
    report(ctx, solution)
    prop.decided = solution.strategies
    if not auto:
        return seeds
    splits = batch_splits(graph, mesh, solution, start)
    ctx.stats["sharding.batch"] = splits
    ctx.diagnostics.extend(s.describe() for s in splits if not s.data_parallel)
    out = Seeds(roles=dict(seeds.roles))
    for i in graph.inputs:
        lay = solution.inputs.get(i.value, seeds.storage.get(i.name, Layout.replicated(mesh)))
        out.storage[i.name] = out.compute[i.name] = lay
    return out


_Laid = tuple[Layout, ...]
_VIEWS: Kept[Target, bool] = {}
"""``is_view`` of each op target asked."""


@dataclass
class _Propagator:
    graph: Graph
    mesh: Mesh
    seeds: Seeds
    table: RuleTable
    ctx: PassContext
    b: GraphBuilder = field(init=False)
    vmap: dict[Value, Value] = field(default_factory=dict)
    moved: dict[tuple[Value, int, str], Value] = field(default_factory=dict)
    """Each value moved, by the id of its interned target layout and the phase."""
    compute: dict[Value, Layout] = field(default_factory=dict)
    layouts: dict[tuple[int, ...], tuple[tuple[Strategy, ...], _Laid, _Laid]] = field(default_factory=dict)
    """``_layouts``' answers; each holds its strategies, so their ids are never others'."""
    interned: dict[Layout, Layout] = field(default_factory=dict)
    """Every layout the built graph's values have, as one object each."""
    param_like: set[Value] = field(default_factory=set)
    warned: set[str] = field(default_factory=set)
    decided: list[list[Strategy]] | None = None
    """Per op (program order), one strategy per mesh axis chosen up front; None: choose greedily."""
    pinned: dict[Value, Layout] = field(default_factory=dict)
    """Inputs every use must read in exactly this layout (the plan's ``pinned``): never moved."""
    models: tuple[AxisModel, ...] = ()
    """The time model of each mesh axis the greedy choice prices moves with (set by ``run``)."""

    def run(self) -> Graph:
        self.b = GraphBuilder(self.graph.name, self.mesh)
        self.models = axis_models(self.mesh, self.ctx.options.cluster)
        self.b.stacks = self.graph.stacks
        compute: dict[Value, Layout] = {}
        for i in self.graph.inputs:
            lay = self._interned(self.seeds.storage.get(i.name, Layout.replicated(self.mesh)))
            new = self.b.add_input(i.kind, i.name, i.value.type, lay)
            self.vmap[i.value] = new
            compute[new] = self.seeds.compute.get(i.name, lay)
        self.compute = compute
        self.param_like = {self.vmap[i.value] for i in self.graph.inputs if i.kind == "param"}
        for k, op in enumerate(self.graph.ops):
            self._op(op, None if self.decided is None else self.decided[k])
            if (
                op.prov.phase == "fwd"
                and len(op.results) == 1
                and (by_identity(_VIEWS, op.target, is_view) or op.target == torch.ops.aten._to_copy.default)
                and any(self.vmap.get(u, u) in self.param_like for u in op.operands)
            ):
                self.param_like.add(self.vmap[op.result])
        grads = {o.name: self.seeds.storage.get(o.name) for o in self.graph.outputs if o.kind in ("grad", "update")}
        for o in self.graph.outputs:
            v = self.vmap[o.value]
            want = grads.get(o.name) if o.kind != "out" else None
            target = want if want is not None else Layout.replicated(self.mesh)
            prov = Provenance("", "bwd" if o.kind == "grad" else "fwd")
            self.b.add_output(o.kind, o.name, self._move(v, self._interned(target), prov))
        return self.b.build()

    def _current(self, v: Value) -> Layout:
        """The layout a value is used in: parameters' compute layout, else its own."""
        return self.compute.get(v, v.layout)

    def candidates(self, op: Op) -> list[Strategy]:
        """The op's single-axis strategies (warning once per op name when only Replicate exists)."""
        strategies, source = strategies_for(op, self.table)
        if source == "replicate" and op.name not in self.warned:
            self.warned.add(op.name)
            self.ctx.warn(f"no sharding rule for {op.name} (first at {op.prov.describe()}); it runs replicated")
        method = cp.method_of(self.ctx)
        return [cp.priced(op, s, method) for s in strategies]

    def _op(self, op: Op, decided: list[Strategy] | None) -> None:
        operands = [self.vmap.get(v, v) for v in op.operands]
        if decided is None:
            strategies = self.candidates(op)
            decided = []
            for axis in self.mesh.names:
                decided.append(self._choose(op, operands, strategies, axis, decided))
        ins, outs = self._layouts(tuple(decided))
        for k, v in enumerate(operands):
            if isinstance(v.type, TensorType) and v.layout is not ins[k]:
                operands[k] = self._move(v, ins[k], op.prov)
        args, kwargs = rebind(op, operands)
        if len(outs) == 1:  # NOTE: mostly so: one value made and mapped without a loop
            (r,) = op.results
            results: tuple[Value, ...] = (Value(r.name, r.type, outs[0]),)
            self.vmap[r] = results[0]
        else:
            results = tuple(Value(r.name, r.type, lay) for r, lay in zip(op.results, outs, strict=True))
            self.vmap.update(zip(op.results, results, strict=True))
        self.b.append(Op(op.target, args, kwargs, results, op.prov))

    def _layouts(self, chosen: tuple[Strategy, ...]) -> tuple[tuple[Layout, ...], tuple[Layout, ...]]:
        """The layouts ``chosen`` (a strategy per axis) gives the op's operands and results, kept by
        the strategies' identities: the ops of every layer choose the same strategy objects, and
        ``Strategy`` hashes by its fields (a Python call)."""
        ids = tuple(map(id, chosen))
        hit = self.layouts.get(ids)
        if hit is None or hit[0] != chosen:  # NOTE: the same objects compare equal at once
            ins = tuple(map(self._layout, zip(*(s.inputs for s in chosen), strict=True)))
            outs = tuple(map(self._layout, zip(*(s.outputs for s in chosen), strict=True)))
            hit = self.layouts[ids] = (chosen, ins, outs)
        return hit[1], hit[2]

    def _layout(self, placements: tuple[Placement, ...]) -> Layout:
        """The layout of these placements, one object per layout (``_op`` then mostly skips ``_move``)."""
        return self._interned(Layout(self.mesh.names, placements))

    def _interned(self, lay: Layout) -> Layout:
        """The one object of ``lay`` (the first made): each value the graph builds has its layout so,
        and so do the layouts it moves to, so layouts compare by identity (``Layout`` compares and
        hashes by its fields, Python calls)."""
        return self.interned.setdefault(lay, lay)

    def _choose(
        self, op: Op, operands: list[Value], strategies: list[Strategy], axis: str, earlier: list[Strategy]
    ) -> Strategy:
        model = self.models[self.mesh.names.index(axis)]
        best: tuple[float, int] | None = None
        best_s = strategies[0]
        for idx, s in enumerate(strategies):
            pinned = {self.vmap.get(v, v): lay for v, lay in self.pinned.items()}
            if not (
                fits_axis(s, operands, op.results, self.mesh, earlier)
                and keeps_pinned(s, operands, pinned, earlier)
                and cp.allows(op, s, self.seeds.roles.get(axis, ""), cp.method_of(self.ctx), earlier)
            ):
                continue
            cost = own_traffic(model, s)
            for v, want in zip(operands, s.inputs, strict=True):
                if isinstance(v.type, TensorType):
                    c = model.greedy_move(self._current(v).placement(axis), want, nbytes(v.type))
                    cost += c * (PARAM_WEIGHT if v in self.param_like else 1.0)
            if best is None or (cost, idx) < best:
                best, best_s = (cost, idx), s
        if best is None:
            raise PassError(f"{op.describe()}: no valid sharding strategy on mesh axis {axis!r}")
        return best_s

    def _move(self, v: Value, target: Layout, prov: Provenance) -> Value:
        """``v`` in ``target`` layout: itself, or a (phase-cached) ``comm.redistribute`` of it."""
        if v.layout is target:  # NOTE: both interned (``_interned``)
            return v
        key = (v, id(target), prov.phase)
        new = self.moved.get(key)
        if new is None:
            new = self.moved[key] = Value(v.name, v.type, target)
            self.b.append(Op(REDISTRIBUTE, (v,), (), (new,), prov))
        return new


__all__ = ["SHARDED", "Sharding"]


def precision_weights(graph: Graph, policy: Precision | None) -> tuple[dict[Value, float], dict[Value, float]]:
    """``Problem.travels`` and ``Problem.states`` under a precision policy: the graph was captured in
    the policy's parameter dtype, the ``precision`` pass (after this one) reduces each gradient in the
    reduce dtype and keeps each parameter in fp32; the solve prices them so."""
    if policy is None:
        return {}, {}
    low = policy.param.itemsize
    states = {
        i.value: torch.float32.itemsize / low  # NOTE: the master weights (precision.MASTER)
        for i in graph.inputs
        if i.kind == "param" and isinstance(i.value.type, TensorType) and i.value.type.dtype == policy.param
    }
    travels = {
        o.value: policy.reduce_dtype.itemsize / low
        for o in graph.outputs
        if o.kind == "grad" and isinstance(o.value.type, TensorType) and o.value.type.dtype == policy.param
    }
    return travels, states
