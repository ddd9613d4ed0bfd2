"""The one compile path: options in, a captured and transformed graph out.

``parallelize``, ``pass-debug``, ``meshfold demo``'s dumps and the golden tests all call
``compile_model``; nothing else parses and runs a pipeline for a model. ``CompileOptions.of`` is the
only place a user's request is read and checked (mesh, plan, expert mapping, cluster, memory bound,
pipeline, backend), so every front end refuses the same bad request with the same words, before
anything is captured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import sympy
import torch
from torch import nn

from meshfold import ir
from meshfold.ir.symbolic import size_hints
from meshfold.passes import JOINT, PassContext, PassError, PassPipeline, PassTiming, parse_size
from meshfold.passes.cp import CpSpec
from meshfold.passes.memory.policies import Saved
from meshfold.passes.moe.spec import MoeSpec, check_spec
from meshfold.passes.pipeline import Callback
from meshfold.passes.sharding.plans import Plan, axis_roles, default_preset, sequence_axes
from meshfold.pp.stage_plan import plan_pipeline
from meshfold.pp.stage_split import AUTO, PP, PipelineSpec, marked_layers
from meshfold.target.hardware import Cluster, parse_cluster
from meshfold.tracing.tracer import capture

# NOTE: grows with every pass that lands. Without a mesh, sharding and boxing leave the
# single-device graph as it is; without an expert mapping, moe-fold does.
DEFAULT_PIPELINE = "cleanup,moe-fold,sharding,boxing,bucket,memory,ring-steps,overlap,verify"
MEMORY_POLICIES = ("full", "selective", "kv", "offload")
"""What ``memory=`` takes besides a byte budget (and a per-value function, ``MemoryPolicy``)."""
MemoryPolicy = Callable[[Saved], str]
"""``parallelize(memory=fn)``: ``fn`` answers ``"save"``, ``"recompute"`` or ``"offload"`` for each
activation the forward hands to the backward (JAX's checkpoint policies are the model)."""

Backend = Literal["eager", "inductor", "ascend"]
PlanSpec = str | Plan | Mapping[str, Any]
"""A preset (``"fsdp+tp"``), a ``Plan``, or ``{fqn_glob: {axis: "S(d)"|"R"|"P"}}`` with an optional
``"preset"`` key."""

log = logging.getLogger("meshfold")


@dataclass(frozen=True)
class CompileOptions:
    """What one compilation targets; build it with ``CompileOptions.of``, which checks it."""

    mesh: ir.Mesh | None = None
    plan: Plan | None = None
    """None: the preset the mesh's axis names imply (``default_preset``)."""
    moe: MoeSpec | None = None
    cp: CpSpec | None = None
    """How attention reads a sequence split over the plan's ``cp`` axes (None: ``CpSpec()``)."""
    pp: PipelineSpec | None = None
    """Pipeline stages over a ``pp`` mesh axis (``mesh`` is then the other axes; ``meshfold.pp.stage_split``)."""
    cluster: Cluster | None = None
    memory: int | None = None
    """Bytes per rank: the sharding solve's bound and the budget the ``memory`` pass recomputes to meet."""
    memory_policy: str | MemoryPolicy | None = None
    """``"full"``, ``"selective"``, ``"kv"``: what the ``memory`` pass recomputes in the backward
    (``passes.memory.policies``); ``"offload"``: every saved activation to the host tier and back;
    a function of ``policies.Saved`` answering ``"save"``, ``"recompute"`` or ``"offload"`` per
    value; None: as the budget needs."""
    pipeline: str = DEFAULT_PIPELINE
    verify: bool = False
    backend: Backend = "eager"
    dynamic: tuple[tuple[int, int], ...] = ()
    """``(input index, dim)`` pairs captured as symbolic sizes: one graph for every value of them
    (``CompileResult.guards`` says for which), priced at the example inputs' sizes."""
    grad: bool = True
    """False: a forward-only program (no tangents, no gradients, no backward collectives), for calls
    under ``torch.no_grad()`` / ``inference_mode()``."""

    @staticmethod
    def of(
        *,
        mesh: ir.Mesh | str | None = None,
        plan: PlanSpec | None = None,
        moe: MoeSpec | Mapping[str, Any] | None = None,
        cp: CpSpec | Mapping[str, Any] | str | None = None,
        pp: PipelineSpec | Mapping[str, Any] | None = None,
        cluster: Cluster | str | None = None,
        memory: int | str | MemoryPolicy | None = None,
        pipeline: str = DEFAULT_PIPELINE,
        verify: bool = False,
        backend: str = "eager",
        grad: bool = True,
    ) -> CompileOptions:
        """Read every form a user may write (strings from the shell, dicts from Python) and check
        them together; raises ``PassError`` naming what is wrong and what to write instead."""
        the_mesh, plan, spec_pp = _pipeline_of(_mesh_of(mesh), plan, pp)
        the_plan = to_plan(plan, the_mesh) if plan is not None else None
        if the_plan is not None and the_mesh is None:
            raise PassError(f"plan {the_plan.preset!r} lays values out on a mesh; give a mesh (e.g. dp=2,tp=2)")
        spec = moe if isinstance(moe, MoeSpec) or moe is None else MoeSpec.of(moe)
        if backend not in get_args(Backend):
            raise PassError(f"backend {backend!r} is not available; backends: {', '.join(get_args(Backend))}")
        options = CompileOptions(
            mesh=the_mesh,
            plan=the_plan,
            moe=spec,
            cp=None if cp is None else CpSpec.of(cp),
            pp=spec_pp,
            cluster=_cluster_of(cluster),
            memory=_memory_bound(memory),
            memory_policy=memory if callable(memory) or memory in MEMORY_POLICIES else None,
            pipeline=str(PassPipeline.parse(pipeline)),
            verify=verify,
            backend=backend,  # type: ignore[arg-type]
            grad=grad,
        )
        options.check_request()
        return options

    def effective_plan(self) -> Plan | None:
        """The plan the sharding pass follows (None without a mesh)."""
        if self.mesh is None:
            return None
        return self.plan if self.plan is not None else Plan.of(default_preset(self.mesh))

    def check(self, initial: frozenset[str] = frozenset()) -> PassPipeline:
        """The parsed pipeline, after checking the options against each other and the pass order
        (``initial``: graph properties the input already has besides ``joint``)."""
        passes = self.check_request()
        passes.check(initial | {JOINT})
        return passes

    def check_request(self) -> PassPipeline:
        """The parsed pipeline, after checking the options against each other (not the pass order,
        which depends on the graph the pipeline starts from)."""
        passes = PassPipeline.parse(self.pipeline)
        names = [p.name for p in passes.passes]
        plan = self.effective_plan()
        if plan is not None and self.mesh is not None:
            axis_roles(plan, self.mesh)  # NOTE: a bad preset or axis fails here, before the capture
        if self.moe is not None:
            if self.mesh is None or plan is None:
                raise PassError("moe= maps the experts onto a mesh: give a mesh (e.g. dp=2,tp=2)")
            check_spec(plan, self.moe, self.mesh)
            if "moe-fold" not in names or ("sharding" in names and names.index("moe-fold") > names.index("sharding")):
                raise PassError(f"moe= needs the moe-fold pass before sharding; pipeline: {passes}")
        if self.cp is not None and (
            plan is None or self.mesh is None or not sequence_axes(axis_roles(plan, self.mesh))
        ):
            raise PassError(
                "cp= says how attention reads a sequence split over a cp mesh axis; use plan='cp' (or "
                "'cp+tp', 'fsdp+cp') on a mesh with a 'cp' axis"
            )
        return passes

    def context(self, status: Callable[[str], AbstractContextManager[object]] | None = None) -> PassContext:
        """A fresh pass context for one compilation with these options."""
        ctx = PassContext(
            mesh=self.mesh,
            plan=self.plan,
            moe=self.moe,
            cp=self.cp,
            cluster=self.cluster,
            memory=self.memory,
            memory_policy=self.memory_policy,
            pipelined=self.pp is not None,
        )
        if status is not None:
            ctx.status = status
        return ctx


@dataclass(frozen=True)
class CompileResult:
    """The captured graph, the graph after the pipeline, and what the passes reported."""

    captured: ir.Graph
    graph: ir.Graph
    pipeline: PassPipeline
    options: CompileOptions
    timings: tuple[PassTiming, ...]
    diagnostics: tuple[str, ...]
    stats: Mapping[str, object] = field(default_factory=dict)
    guards: tuple[sympy.Basic, ...] = ()
    """With ``dynamic``: the conditions on the symbolic sizes under which the graph is the model's."""


def compile_model(
    source: nn.Module | ir.Graph,
    example_inputs: Sequence[Any] | None = None,
    options: CompileOptions | str = CompileOptions(),
    *,
    callback: Callback | None = None,
    before: Callable[[ir.Graph], None] | None = None,
    assume: frozenset[str] = frozenset(),
    status: Callable[[str], AbstractContextManager[object]] | None = None,
) -> CompileResult:
    """Capture ``source`` (a model called on ``example_inputs``) or take it as it is (an IR graph),
    then run the options' pipeline, calling ``before(graph)`` on the pipeline's input and
    ``callback(index, pass, graph_after)`` after each pass.

    ``options`` may be a pipeline string (no mesh). ``assume``: graph properties taken as holding for
    an IR graph (``sharded`` for a graph that already carries layouts). ``status`` shows each long
    stage (default: ``progress()``). The pipeline is checked before the capture starts.
    """
    opts = options if isinstance(options, CompileOptions) else CompileOptions.of(pipeline=options)
    passes = opts.check(assume)
    guards: list[sympy.Basic] = []
    hints: dict[str, int] = {}
    ctx = opts.context(status if status is not None else progress())
    if isinstance(source, ir.Graph):
        if opts.mesh is not None and source.mesh is not None and opts.mesh != source.mesh:
            raise PassError(f"the mesh {opts.mesh} differs from the {source.mesh} the graph declares; match it")
        if opts.mesh is None and source.mesh is not None:
            ctx.mesh = source.mesh
        captured = source
    else:
        if example_inputs is None:
            raise PassError("compiling a model needs its example inputs")
        marks = marked_layers(source) if opts.pp is not None else contextlib.nullcontext()
        with ctx.status(f"capturing {type(source).__name__}"), marks:
            # NOTE: moe-fold applies the expert mapping
            captured = capture(source, tuple(example_inputs), dynamic=opts.dynamic, guards=guards)
        hints = _hints(captured, example_inputs, opts.dynamic)
    if not opts.grad:
        captured = forward_only(captured)
    if before is not None:
        before(captured)
    with size_hints(hints):
        graph, timings = passes.run(ctx, captured, callback, initial=assume | {JOINT})
        if opts.pp is not None and opts.grad:
            ctx.stats["pp.plan"] = plan_pipeline(graph, opts.pp, opts.cluster, opts.memory)
    return CompileResult(
        captured, graph, passes, opts, tuple(timings), tuple(ctx.diagnostics), dict(ctx.stats), tuple(guards)
    )


def _hints(graph: ir.Graph, inputs: Sequence[Any], dynamic: Sequence[tuple[int, int]]) -> dict[str, int]:
    """Each symbolic size's value in the example inputs: what the passes price it at."""
    user = [i.value.type for i in graph.inputs if i.kind == "input"]
    hints: dict[str, int] = {}
    for k, d in dynamic:
        x = inputs[k]
        # NOTE: graph inputs are the tensor arguments, in order
        t = user[sum(isinstance(y, torch.Tensor) for y in inputs[:k])] if isinstance(x, torch.Tensor) else None
        if isinstance(t, ir.TensorType) and d < t.rank and isinstance(t.shape[d], sympy.Symbol):
            hints[str(t.shape[d])] = int(x.shape[d])
    return hints


def forward_only(graph: ir.Graph) -> ir.Graph:
    """``graph`` without its backward: no tangent inputs, no gradient outputs, no backward ops (the
    cleanup pass then drops forward ops only the backward needed)."""
    return dataclasses.replace(
        graph,
        inputs=tuple(i for i in graph.inputs if i.kind != "tangent"),
        ops=tuple(op for op in graph.ops if op.prov.phase == "fwd"),
        outputs=tuple(o for o in graph.outputs if o.kind != "grad"),
    )


def to_plan(plan: PlanSpec, mesh: ir.Mesh | None) -> Plan:
    """A preset string, a ``Plan``, or a user dict ``{fqn_glob: {axis: "S(d)"|"R"|"P"}}`` with an
    optional ``"preset"`` key (default: from the mesh's axis names, see ``default_preset``)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str):
        return Plan.of(plan)
    entries = dict(plan)
    preset = entries.pop("preset", None)
    if preset is None:
        if mesh is None:
            raise PassError("a plan dict without a 'preset' needs a mesh to infer it from")
        preset = default_preset(mesh)
    for glob, axes in entries.items():
        if not isinstance(axes, Mapping):
            raise PassError(f"plan entry {glob!r} must map mesh axes to placements, e.g. {{'tp': 'S(0)'}}")
    return Plan.of(str(preset), entries)


def _pipeline_of(
    mesh: ir.Mesh | None, plan: PlanSpec | None, pp: PipelineSpec | Mapping[str, Any] | None
) -> tuple[ir.Mesh | None, PlanSpec | None, PipelineSpec | None]:
    """A mesh with a ``pp`` axis pipelines the model over it: the passes see the other axes (a mesh of
    ``pp`` alone: one ``dp`` rank), the plan without its ``pp`` part (``"pp+fsdp"`` -> ``"fsdp"``)."""
    parts = plan.split("+") if isinstance(plan, str) else []
    if mesh is None or PP not in mesh.names:
        if pp is not None or PP in parts:
            raise PassError(f"pipeline parallelism runs over a mesh axis named {PP!r}; add one (e.g. pp=2,dp=2)")
        return mesh, plan, None
    if "auto" in parts and not (isinstance(pp, Mapping) and "schedule" in pp) and not isinstance(pp, PipelineSpec):
        pp = {**(pp or {}), "schedule": AUTO}  # NOTE: plan="pp+auto" chooses the schedule too
    spec = PipelineSpec.of(pp, mesh.size(PP))
    rest = [(n, s) for n, s in zip(mesh.names, mesh.sizes, strict=True) if n != PP] or [("dp", 1)]
    others = ir.Mesh(tuple(n for n, _ in rest), tuple(s for _, s in rest))
    if isinstance(plan, str):
        plan = "+".join(p for p in parts if p != PP) or None
    return others, plan, spec


def _mesh_of(mesh: ir.Mesh | str | None) -> ir.Mesh | None:
    if mesh is None or isinstance(mesh, ir.Mesh):
        return mesh
    try:
        return ir.Mesh.parse(mesh)
    except ValueError as e:
        raise PassError(f"mesh {mesh!r} is malformed: {e}; write e.g. dp=2,tp=2") from None


def _cluster_of(cluster: Cluster | str | None) -> Cluster | None:
    if not isinstance(cluster, str):
        return cluster
    try:
        return parse_cluster(cluster)
    except ValueError as e:
        raise PassError(f"cluster {cluster!r}: {e}") from None


def progress() -> Callable[[str], AbstractContextManager[object]]:
    """How a long stage shows what it is doing: a spinner on a terminal (``rich``), else lines in the
    ``meshfold`` log: one at DEBUG when it starts, one at INFO with its time when it took a second
    or more. ``MESHFOLD_PROGRESS=log`` asks for the log lines on a terminal too (a program that shows
    its own spinner, such as ``meshfold demo``, sets it for its ranks)."""
    spinner = sys.stderr.isatty() and os.environ.get("MESHFOLD_PROGRESS", "") != "log"
    return _Spinner() if spinner else _logged


class _Spinner:
    """One ``rich`` status line for nested stages (rich allows one live display at a time): an inner
    stage's message is shown after its outer one's."""

    def __init__(self) -> None:
        from rich.console import Console

        self._console = Console(stderr=True)
        self._live: Any = None
        self._stack: list[str] = []

    @contextlib.contextmanager
    def __call__(self, message: str) -> Iterator[None]:
        if self._live is None:
            with self._console.status(message) as live:
                self._live, self._stack = live, [message]
                try:
                    yield
                finally:
                    self._live = None
            return
        self._stack.append(message)
        self._live.update(" · ".join(self._stack))
        try:
            yield
        finally:
            self._stack.pop()
            self._live.update(" · ".join(self._stack))


@contextlib.contextmanager
def _logged(message: str) -> Iterator[None]:
    log.debug("%s ...", message)
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    if seconds >= 1.0:
        log.info("%s: done in %.1f s", message, seconds)


def _memory_bound(memory: int | str | MemoryPolicy | None) -> int | None:
    """The byte bound ``memory=`` gives (None for a policy such as ``"full"``, or a function)."""
    if callable(memory):
        return None
    if not isinstance(memory, str) or memory in MEMORY_POLICIES:
        return None if isinstance(memory, str) else memory
    try:
        return parse_size(memory)
    except PassError:
        raise PassError(
            f"memory={memory!r} is neither a size (e.g. 6GiB) nor a policy ({', '.join(MEMORY_POLICIES)})"
        ) from None
