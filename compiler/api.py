"""``parallelize``: the front door. Capture, choose layouts, insert collectives, lower, run."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import sympy
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshfold import ir
from meshfold.backends.eager import Lowered, RankContext, lower
from meshfold.backends.select import check_float8, select
from meshfold.passes import PassError
from meshfold.passes.base import quiet
from meshfold.passes.memory.activations import memory_line
from meshfold.passes.options import Options, PlanSpec
from meshfold.passes.precision import MASTER
from meshfold.passes.schedule.timeline import predicted, to_chrome_trace, write_trace
from meshfold.passes.sharding.ilp.problem import solve_report
from meshfold.passes.sharding.plans import AUTO
from meshfold.passes.stages import PP, PipelineSpec
from meshfold.pp.stage_module import stage_lowering
from meshfold.pp.stage_plan import PipelinePlan, pipeline_line
from meshfold.pp.stage_split import stage_graphs
from meshfold.pp.tied import tied_parameters
from meshfold.runtime.groups import MeshGroups
from meshfold.runtime.parallel_module import ParallelModule
from meshfold.runtime.programs import Program
from meshfold.runtime.signature import Signature, under_autocast
from meshfold.session import CompileResult, check_backend, compile_model, progress
from meshfold.target.hardware import device_cluster
from meshfold.world import choose


def ir_mesh(mesh: DeviceMesh) -> ir.Mesh:
    """The IR's description of a ``DeviceMesh`` (which must have named dims)."""
    names = mesh.mesh_dim_names
    if not names:
        raise PassError(
            "the DeviceMesh has no dim names; create it with "
            "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))"
        )
    return ir.Mesh(tuple(names), tuple(int(s) for s in mesh.mesh.shape))


def parallelize(
    model: nn.Module | None = None,
    mesh: DeviceMesh | int | None = None,
    example_inputs: Sequence[Any] | None = None,
    plan: PlanSpec | None = None,
    **options: Any,
) -> Any:
    """Compile ``model`` for ``mesh`` with ``plan`` and return this rank's ``ParallelModule``.

    ``plan``: a preset (``"fsdp+tp"``), ``"auto"``, a ``Plan`` or a dict of per-parameter layouts;
    None (the default, as for ``pass-debug`` and ``meshfold demo``): the preset the mesh's axis names
    imply (``passes.sharding.plans.effective_plan``: ``dp`` is fsdp, ``tp`` tp, ``cp`` cp). Every
    other keyword is a field of ``meshfold.Options`` (read and checked by ``Options.of``; an unknown
    one is refused naming the nearest); the main ones:

    Everything that can be wrong with the request (mesh vs world size, unknown preset or axis,
    indivisible sizes) raises before any collective; a batch the data-parallel ranks do not divide
    is split over the axes that divide it and computed whole on the others.
    ``verify``: the first step also checks every value on every rank against the single-device
    model and raises ``VerificationError`` naming the first that differs (op, module path, layouts).

    Without a model, ``@parallelize(mesh=..., plan=...)`` decorates an ``nn.Module`` subclass: its
    instances are instances of that class, compiled at construction when ``example_inputs`` are
    given (so ``AdamW(net.parameters())`` right after works), else on their first call.

    ``mesh`` may be the world instead, a rank count or a 1-D ``DeviceMesh`` without dim names, with
    ``plan="auto"``: then every factorization of it into ``dp``, ``cp`` and ``tp`` axes (and ``pp``
    when ``pp=`` is given) is compiled and priced, the fastest that fits is built as the module's
    ``DeviceMesh`` (``pm.mesh``), and ``pm.plan_report()`` starts with every candidate's predicted
    step and peak (``meshfold.world``).

    ``plan="auto"``: the sharding solve chooses every parameter's and input's layout as well, for
    the hardware ``cluster`` (``"h100:8x1"``; default: on a CUDA mesh, the catalog part its GPUs are,
    H100, H200 or A100, ``LOCAL_WORLD_SIZE`` to a node; else gloo ranks on this CPU) under a
    per-device ``memory`` bound (bytes or ``"40GiB"``; default: the cluster's device memory). The
    passes after the solve (the overlap schedule, the memory pass's prices) use the same cluster.

    ``memory``: a byte budget per rank (``"6GiB"``) also has the ``memory`` pass keep, recompute or
    offload each block's activations, whichever adds least time while the predicted peak fits (and
    raise before anything runs when nothing can); ``memory="full"`` recomputes every block from its
    input, ``"selective"``, ``"kv"`` parts of each attention, ``"offload"`` sends every saved
    activation to host memory; a function of ``meshfold.passes.memory.policies.Saved`` answering
    ``"save"``, ``"recompute"`` or ``"offload"`` decides value by value.

    ``moe={"ep": 4, "etp": 1}``: the routed experts of every MoE layer meshfold recognizes (see
    ``meshfold.tracing.moe_layers``) get their own mapping of the same ranks: EP ranks split the experts (innermost
    mesh axes after ETP), the rest of the world (EDP) replicates them, whatever ``plan`` does with
    attention. Invalid mappings raise before anything runs, naming the rule.

    ``cp={"method": "ring"}``: how attention reads a sequence a ``cp`` mesh axis splits (``plan="cp"``):
    ``"ring"`` keeps it split by sequence (ring attention: keys and values passed round the axis's
    ranks while each block computes), ``"tokenring"`` too, the queries travelling instead,
    ``"ulysses"`` splits it by heads or batch through an all-to-all, ``"auto"`` (the default) takes
    whichever the sharding solve prices cheaper (ring attention, or Ulysses).

    ``pp={"schedule": "1f1b", "microbatches": 4}`` on a mesh with a ``pp`` axis (``plan="pp+fsdp"``):
    the layer stack is split into pipeline stages along it (``"gpipe"``, ``"1f1b"``, or
    ``"interleaved"`` with ``"virtual"`` stages per rank, default 2, ``"zero-bubble"``, or ``"auto"``:
    the one the time model predicts fastest, which ``plan="pp+auto"`` asks for when no schedule is
    given), the rest of the plan laid out on the other axes; the result is a ``PipelinedModule`` that
    trains by ``pm.step(*inputs)`` (see ``meshfold.pp.pipelined``).

    Every call is checked on every rank alike before any collective of the program. A call with
    other input shapes or dtypes, in the other mode (``pm.eval()``), or under ``torch.no_grad()``
    (a forward-only program) gets its own program, compiled on first use; the module keeps
    ``cache_size`` of them (``pm.programs()`` lists them). A call no program can run (a bf16 input to
    an fp32 model) raises ``CallMismatch`` naming the input and both signatures.

    ``backend``: how each rank's programs run: ``"eager"`` op by op, ``"inductor"`` compiled by
    TorchInductor on first call (``meshfold.backends.inductor``; what it cannot compile is refused
    here, naming the op).

    ``timeout`` (seconds or a ``timedelta``): how long any collective of the module waits for the
    other ranks (default: the process group's own, 30 minutes for gloo); a rank that stops answering
    then surfaces on the others as ``CollectiveError`` naming the collective, the op and the mesh axis.

    ``trace``: rank 0 writes the predicted timeline of the compiled program (its compute and
    communication streams, by the time model the passes schedule with) there, as a Chrome/Perfetto
    trace.
    """
    if mesh is None:
        raise PassError("parallelize needs a mesh: parallelize(model, init_device_mesh(...), example_inputs, plan=...)")
    if isinstance(mesh, int) or (mesh.ndim == 1 and not mesh.mesh_dim_names):
        world = mesh if isinstance(mesh, int) else mesh.size()
        given = "" if isinstance(mesh, int) else "the mesh has no dim names, so it is taken as the world: "
        _world_request(world, plan, options, given)
        if model is None:
            return _decorator(lambda m, x: _from_world(m, world, x, plan, dict(options)), example_inputs)
        return _from_world(model, world, example_inputs, plan, options)
    if options.get("cluster") is None and mesh.device_type == "cuda":  # NOTE: plan for the GPUs the ranks have
        options["cluster"] = _cuda_cluster(mesh.size())
    opts = Options.of(mesh=ir_mesh(mesh), plan=plan, **options)
    check_backend(opts.backend)
    if opts.precision is not None:
        check_precision(opts, model)
    if model is None:
        return _decorator(lambda m, x: _compile(m, mesh, x, opts), example_inputs)
    if example_inputs is None:
        raise PassError("parallelize(model, mesh, example_inputs, plan=...) needs the example inputs")
    if opts.pp is not None:
        return _pipelined(model, mesh, example_inputs, opts)
    return _compile(model, mesh, example_inputs, opts)


def _from_world(
    model: nn.Module | None,
    world: int,
    example_inputs: Sequence[Any] | None,
    plan: PlanSpec | None,
    options: dict[str, Any],
) -> Any:
    """``parallelize`` on a world of ``world`` ranks: rank 0 prices every mesh (``world.choose``) and
    every rank builds the winner's ``DeviceMesh`` and lowers rank 0's compile of it."""
    if model is None or example_inputs is None:
        raise PassError(
            "choosing the mesh for a world compiles the model: "
            "call parallelize(model, world, example_inputs, plan='auto')"
        )
    if not dist.is_initialized():
        raise PassError("parallelize needs torch.distributed initialized (run under torchrun or spawn ranks)")
    have = dist.get_world_size()
    if world != have:
        raise PassError(f"the world given has {world} ranks but torch.distributed has {have}; give {have}")
    device = _device_of(example_inputs).type
    if options.get("cluster") is None and device == "cuda":
        options["cluster"] = _cuda_cluster(world)
    # NOTE: a bad keyword fails on every rank alike (pp= and cp= need their axes, which candidates have)
    Options.of(
        plan=AUTO, mesh=ir.Mesh(("dp",), (world,)), **{k: v for k, v in options.items() if k not in ("pp", "cp")}
    )
    payload: list[Any] = [None]
    precompiled: tuple[CompileResult, tuple[str, ...]] | None = None
    if dist.get_rank() == 0:
        try:
            choice, result = choose(model, example_inputs, world, options)
            payload[0] = ("ok", choice.chosen.mesh.names, choice.chosen.mesh.sizes)
            precompiled = (result, choice.lines())
        except Exception as e:
            payload[0] = ("error", f"{type(e).__name__}: {e}", ())
            dist.broadcast_object_list(payload, src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    kind, names, sizes = payload[0]
    if kind != "ok":
        raise PassError(f"choosing the mesh failed on rank 0: {names}")
    mesh = init_device_mesh(device, tuple(sizes), mesh_dim_names=tuple(names))
    opts = Options.of(mesh=ir_mesh(mesh), plan=AUTO, **options)
    if opts.pp is not None:
        return _pipelined(model, mesh, example_inputs, opts, precompiled)
    return _compile(model, mesh, example_inputs, opts, precompiled)


def _world_request(world: int, plan: PlanSpec | None, options: dict[str, Any], given: str = "") -> None:
    """Raise ``PassError`` (on every rank alike, before anything is compiled) unless a world can be
    compiled with ``plan`` and ``options``; ``given`` starts the message (what was taken as the world)."""
    if plan != AUTO:
        raise PassError(
            f"{given}a world of {world} ranks (a rank count, or a 1-D mesh without dim names) needs plan='auto', "
            "which chooses the mesh; or give a DeviceMesh with named dims (init_device_mesh(..., mesh_dim_names=...))"
        )
    # NOTE: a bad keyword fails here (pp= and cp= need their axes, which the candidates have)
    Options.of(
        plan=AUTO, mesh=ir.Mesh(("dp",), (world,)), **{k: v for k, v in options.items() if k not in ("pp", "cp")}
    )


def _cuda_cluster(ranks: int) -> Any:
    """The catalog part the CUDA ranks are, ``LOCAL_WORLD_SIZE`` to a node (None if not in the catalog)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    return device_cluster(torch.cuda.get_device_name(), per_node, ranks)


def _pipelined(
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[Any],
    options: Options,
    precompiled: tuple[CompileResult, tuple[str, ...]] | None = None,
) -> Any:
    """Compile one microbatch on the mesh's other axes, split it into stages, lower this rank's."""
    from meshfold.pp.pipelined import PipelinedModule, StageCheck, microbatch, stage_mesh  # NOTE: loads pipelining

    spec = options.pp
    assert spec is not None and options.mesh is not None
    if not dist.is_initialized():
        raise PassError("parallelize needs torch.distributed initialized (run under torchrun or spawn ranks)")
    micro = microbatch(example_inputs, spec)  # NOTE: before stage_mesh, which may make groups (a collective)
    full, sub = stage_mesh(mesh, options.mesh)
    compiled = _compile_once(model, micro, options, first=True, precompiled=precompiled)
    graph, planned = compiled.graph, compiled.staged
    assert planned is not None  # NOTE: compile_model plans the stages of a pp compile with gradients
    spec = planned.spec
    graphs = stage_graphs(graph, planned.split)
    groups = MeshGroups.of(sub, options.timeout)
    rank = groups.rank_context(options.mesh, graph)  # NOTE: the same groups on every rank, whatever its stages
    rng = torch.Generator()  # NOTE: random ops draw alike on every rank, as in ``_compile``
    rng.set_state(compiled.rng_state)
    mine = spec.held(full.get_local_rank(PP))
    held = {s: (graphs[s], _stage_program(graphs[s], spec, rank, rng, options, full.device_type)) for s in mine}
    check = None
    if options.verify:
        recording = {s: stage_lowering(graphs[s], spec, rank, rng, record=True) for s in mine}
        check = StageCheck(graph, rank, recording)
    names = [i.name for i in graph.inputs if i.kind == "input"]
    lines = (*compiled.report, pipeline_line(planned))
    return PipelinedModule(model, full, sub, planned, held, names, tied_parameters(graphs), lines, check)


def check_precision(options: Options, model: nn.Module | None) -> None:
    """Raise ``PassError`` unless ``options.precision`` can hold ``model``'s parameters as fp32 master
    weights (every rank checks the same model, before any collective); a policy does not yet combine
    with a pipeline or with ``verify``."""
    if options.pp is not None or options.verify:
        what = "a pp axis" if options.pp is not None else "verify=True"
        raise PassError(f"precision= does not combine with {what} yet; drop one of them")
    for name, p in [] if model is None else model.named_parameters():
        if p.is_floating_point() and p.dtype != MASTER:
            raise PassError(
                f"precision= keeps the parameters as fp32 master weights, but {name} is {p.dtype}; "
                "call model.float() first (the policy casts them for compute), or drop precision="
            )


def _compile(
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[Any],
    options: Options,
    precompiled: tuple[CompileResult, tuple[str, ...]] | None = None,
) -> ParallelModule:
    if not dist.is_initialized():
        raise PassError("parallelize needs torch.distributed initialized (run under torchrun or spawn ranks)")
    if options.precision is not None:
        check_precision(options, model)
    world = dist.get_world_size()
    if mesh.size() != world:
        raise PassError(
            f"the mesh has {mesh.size()} ranks {tuple(mesh.mesh.shape)} but the world has {world}; "
            f"build the mesh over all {world} ranks"
        )
    groups = MeshGroups.of(mesh, options.timeout)
    # NOTE: the program's random ops draw from their own generator, seeded from rank 0's default
    # generator as it is now, so every rank draws alike whatever its own seed (backends/random.py)
    rng = torch.Generator()
    compiled = _compile_once(model, example_inputs, options, first=True, precompiled=precompiled)
    if options.trace is not None and dist.get_rank() == 0:
        write_trace(to_chrome_trace(predicted(compiled.graph, options.cluster)), options.trace)
    rng.set_state(compiled.rng_state)
    sig = Signature.of(example_inputs, model.training, grad=True)
    first = _program(compiled.graph, groups, options, sig, rng)
    first.report = compiled.report
    compiler = _Recompiler(_skeleton(model), groups, options, rng)
    return ParallelModule(
        model,
        mesh,
        first,
        compiler,
        options.cache_size,
        shapes=compiler.shapes,
        rng=rng,
        world=groups.world,
        timeout=options.timeout,
    )


@dataclass
class _Recompiler:
    """New programs for a module: compiled on rank 0 from a copy of the model without weights,
    lowered on every rank with the module's generator."""

    shapes: nn.Module
    groups: MeshGroups
    options: Options
    rng: torch.Generator

    def compile(
        self, inputs: Sequence[Any], sig: Signature, dynamic: tuple[tuple[int, int], ...]
    ) -> tuple[ir.Graph, tuple[sympy.Basic, ...]]:
        # NOTE: a preset lays parameters out alike for every call; ``auto`` solves again, and a program
        # whose solve moved a parameter is refused (``Programs``), as the module holds one layout each
        opts = dataclasses.replace(self.options, grad=sig.grad, verify=False, dynamic=dynamic)
        was = self.shapes.training
        self.shapes.train(sig.training)
        try:
            with under_autocast(sig.autocast):  # NOTE: capture records autocast's casts as the call has them
                compiled = _compile_once(self.shapes, inputs, opts, first=False)
        finally:
            self.shapes.train(was)
        return compiled.graph, compiled.guards

    def lower(self, graph: ir.Graph, sig: Signature) -> Program:
        return _program(graph, self.groups, dataclasses.replace(self.options, verify=False), sig, self.rng)


def _program(graph: ir.Graph, groups: MeshGroups, options: Options, sig: Signature, rng: torch.Generator) -> Program:
    """Lower ``graph`` for this rank (collective where it needs process groups over several axes)."""
    assert options.mesh is not None
    # NOTE: every rank compiled the same graph, so all create the same groups in the same order
    rank = groups.rank_context(options.mesh, graph)
    if options.cp is not None and options.cp.method == "tokenring":
        rank = dataclasses.replace(rank, cp_method="tokenring")
    # NOTE: only rank 0 shows progress (it alone compiled); every rank lowers its own program
    status = progress() if dist.get_rank() == 0 else quiet
    with status(f"lowering each rank's program ({options.backend})"):
        lowered = _backend(graph, lower(graph, rank, rng=rng), rank, options, groups.mesh.device_type)
        checked = (lower(graph, rank, record=True, rng=rng), rank) if options.verify else None
    return Program(sig, graph, lowered, checked)


def _backend(graph: ir.Graph, lowered: Lowered, rank: RankContext, options: Options, device: str) -> Lowered:
    """``lowered`` (from ``graph``) as ``options.backend`` runs it (``backends.select``)."""
    return select(
        options.backend, graph, lowered, rank, device, f"rank {dist.get_rank()} {rank.coordinate} of {rank.mesh}"
    )


def _stage_program(
    graph: ir.Graph, spec: PipelineSpec, rank: RankContext, rng: torch.Generator, options: Options, device: str
) -> Lowered:
    """A stage's program for this rank, as ``options.backend`` runs it (``stage_module.stage_lowering``)."""
    return _backend(graph, stage_lowering(graph, spec, rank, rng), rank, options, device)


def _skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device: what recompiling for
    another call needs (capture runs on fake tensors), without holding a second copy of the weights.
    NOTE: a model that cannot be deep-copied is kept itself (its weights stay alive)."""
    memo: dict[int, Any] = {}
    for t in model.parameters():
        memo[id(t)] = nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
    for t in model.buffers():
        memo[id(t)] = torch.empty_like(t, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:
        return model


@dataclass(frozen=True)
class _Compiled:
    """What rank 0's compile gives every rank: the graph, rank 0's generator state, the guards of the
    graph's symbolic sizes, the plan report (``solve_report``, then the memory pass's
    ``memory_line``) and, for a pipeline, its stages (``CompileResult.staged``)."""

    graph: ir.Graph
    rng_state: torch.Tensor
    guards: tuple[sympy.Basic, ...]
    report: tuple[str, ...]
    staged: PipelinePlan | None


def _compile_once(
    model: nn.Module,
    example_inputs: Sequence[Any],
    options: Options,
    *,
    first: bool,
    precompiled: tuple[CompileResult, tuple[str, ...]] | None = None,
) -> _Compiled:
    """Compile on rank 0 only; every rank gets the graph as IR text and the rest of ``_Compiled``.
    ``precompiled`` (rank 0's, from choosing the mesh): the compile to use and the report lines
    that go before its own.

    NOTE: one plan for all ranks by construction (whatever a rank's library versions or state),
    and the other ranks do not repeat the work. A failure
    on rank 0 is sent as its message and raised on every rank (on rank 0 as itself when ``first``)."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            rng_state = torch.get_rng_state()
            result = compile_model(model, example_inputs, options) if precompiled is None else precompiled[0]
            check_float8(result.graph, _device_of(example_inputs))
            memory = memory_line(result.stats)
            chosen = () if precompiled is None else precompiled[1]
            report = (*chosen, *solve_report(result.stats), *([memory] if memory else []))
            payload[0] = ("ok", str(result.graph), rng_state, result.guards, report, result.staged)
        except Exception as e:
            payload[0] = ("error", f"{type(e).__name__}: {e}", None, (), (), None)
            dist.broadcast_object_list(payload, src=0)
            if first:
                raise
            raise PassError(f"{type(e).__name__}: {e}") from e
    dist.broadcast_object_list(payload, src=0)
    kind, text, rng_state, guards, report, staged = payload[0]
    if kind != "ok":
        raise PassError(text if not first else f"compilation failed on rank 0: {text}")
    return _Compiled(ir.parse(text, positions=False), rng_state, tuple(guards), tuple(report), staged)


def _device_of(inputs: Sequence[Any]) -> torch.device:
    """Where a program runs: its first tensor input's device (CPU for a call with none)."""
    return next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


M = TypeVar("M", bound=nn.Module)


Build = Callable[[nn.Module, Sequence[Any]], ParallelModule]
"""How a decorated class compiles an instance: its model and inputs in, the compiled module out."""


def _decorator(build: Build, example_inputs: Sequence[Any] | None) -> Callable[[type[M]], type[M]]:
    def deco(cls: type[M]) -> type[M]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise PassError(f"@parallelize(...) decorates nn.Module subclasses, not {cls!r}")
        return _parallel_class(cls, build, example_inputs)

    return deco


def _parallel_class(cls: type[M], build: Build, example_inputs: Sequence[Any] | None) -> type[M]:
    """A subclass of ``cls`` whose instances build the model with ``cls``'s constructor, then hold
    its compiled form: the compiled module's parameters (DTensors) under the model's own FQNs."""

    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        model = cls(*args, **kwargs)
        nn.Module.__init__(self)  # NOTE: not cls.__init__: self holds only the compiled module's state
        self._mf_model = [model]  # NOTE: a list, so the single-device model is not a submodule
        self._mf_compiled: list[ParallelModule] = []
        if example_inputs is not None:
            _adopt(self, build(model, example_inputs))

    def forward(self: nn.Module, *inputs: Any) -> Any:
        if not self._mf_compiled:
            _adopt(self, build(self._mf_model[0], inputs))
        pm = self._mf_compiled[0]
        pm.train(self.training)  # NOTE: pm is held aside, not a child: eval() reaches it only here
        return pm(*inputs)

    def parameters(self: nn.Module, recurse: bool = True) -> Any:
        if not self._mf_compiled:
            raise PassError(
                f"{cls.__name__} is compiled on its first call, so it has no parameters yet; give "
                "@parallelize(..., example_inputs=...) to compile at construction, or create the optimizer "
                "after the first call"
            )
        return nn.Module.parameters(self, recurse)

    body = {"__init__": __init__, "forward": forward, "parameters": parameters, "__module__": cls.__module__}
    parallel = type(cls.__name__, (cls,), body)
    parallel.__qualname__ = cls.__qualname__
    parallel.__doc__ = cls.__doc__
    return parallel  # type: ignore[return-value]


def _adopt(host: nn.Module, pm: ParallelModule) -> None:
    """Make ``pm``'s modules and parameters ``host``'s, under the model's own names."""
    host._mf_compiled.append(pm)  # type: ignore[operator]
    for name, child in pm._modules.items():
        host.add_module(name, child)
    for name, p in pm._parameters.items():
        host.register_parameter(name, p)
