"""``Options``: one compilation's request, read once.

``parallelize``'s keywords, ``pass-debug``'s flags and the pass context all are this record: each
field says what it means (its ``help``, which is also the flag's), and ``Options.of`` is the only
place a user's spelling of it (a string from the shell, a dict from Python) is read and checked, so
every front end refuses the same bad request with the same words before anything is captured.
Adding an option is adding a field here and reading ``ctx.options.<field>`` in the pass that uses it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from meshfold.ir import Mesh
from meshfold.passes.base import JOINT, PassError, key_values
from meshfold.passes.cp import CpSpec
from meshfold.passes.memory.policies import Saved
from meshfold.passes.moe.spec import MoeSpec, check_spec
from meshfold.passes.pipeline import PassPipeline, parse_size
from meshfold.passes.precision import Precision
from meshfold.passes.sharding.plans import Plan, axis_roles, effective_plan, sequence_axes
from meshfold.passes.stages import AUTO, PP, PipelineSpec
from meshfold.target.cluster_file import load_cluster
from meshfold.target.hardware import Cluster

# NOTE: grows with every pass that lands. Without a mesh, sharding and boxing leave the
# single-device graph as it is; without an expert mapping, moe-fold does.
DEFAULT_PIPELINE = "cleanup,moe-fold,sharding,boxing,precision,float8-gather,bucket,memory,ring-steps,overlap,verify"
DEFAULT_CACHE = 8
"""Programs a module keeps (one per call signature: shapes, mode, grad), least recently used first out."""
MEMORY_POLICIES = ("full", "selective", "kv", "offload")
"""What ``memory=`` takes besides a byte budget (and a per-value function, ``MemoryPolicy``)."""
MemoryPolicy = Callable[[Saved], str]
"""``parallelize(memory=fn)``: ``fn`` answers ``"save"``, ``"recompute"`` or ``"offload"`` for each
activation the forward hands to the backward (JAX's checkpoint policies are the model)."""
PlanSpec = str | Plan | Mapping[str, Any]
"""A preset (``"fsdp+tp"``), a ``Plan``, or ``{fqn_glob: {axis: "S(d)"|"R"|"P"}}`` with an optional
``"preset"`` key."""


def _help(help: str, *, flag: str | None = "", metavar: str | None = None) -> dict[str, Any]:
    """An ``Options`` field's metadata: ``help`` says what it means; ``flag`` is its ``pass-debug``
    flag (``""``: ``--`` and the field's name, ``None``: none, it is set some other way)."""
    return {"help": help, "flag": flag, "metavar": metavar}


@dataclass(frozen=True)
class Options:
    """What one compilation targets; build it with ``Options.of``, which reads and checks it."""

    mesh: Mesh | None = field(
        default=None,
        metadata=_help(
            "device mesh, e.g. dp=2,tp=2 (an IR file may declare its own); with a pp axis, the other axes",
            metavar="MESH",
        ),
    )
    plan: Plan | None = field(
        default=None,
        metadata=_help("preset such as fsdp+tp, or auto; None: the one the mesh's axis names imply (effective_plan)"),
    )
    moe: MoeSpec | None = field(
        default=None, metadata=_help("expert mapping for the routed experts, e.g. ep=4 or ep=2,etp=1", metavar="SPEC")
    )
    cp: CpSpec | None = field(
        default=None,
        metadata=_help(
            "how attention reads a sequence split over a cp axis: ring, tokenring, ulysses or auto; None: auto",
            metavar="METHOD",
        ),
    )
    pp: PipelineSpec | None = field(
        default=None,
        metadata=_help(
            "pipeline over a pp mesh axis, e.g. schedule=auto,microbatches=4 (schedules: gpipe, 1f1b, interleaved, "
            "zero-bubble, or auto: the one the time model predicts fastest; virtual= stages per rank)",
            metavar="SPEC",
        ),
    )
    cluster: Cluster | None = field(
        default=None,
        metadata=_help(
            "cluster the plan is made for: catalog text such as h100:8x1, or a cluster file written by meshfold "
            "calibrate (a path ending in .json); None: gloo ranks on this CPU (the catalog's figures)"
        ),
    )
    memory: int | None = field(
        default=None,
        metadata=_help(
            "bytes per device (e.g. 40GiB): the sharding solve's bound and the budget the memory pass recomputes "
            "to meet; or full, selective, kv, offload: what the memory pass recomputes or offloads; None: the "
            "cluster's bound, nothing recomputed"
        ),
    )
    memory_policy: str | MemoryPolicy | None = field(
        default=None,
        metadata=_help(
            "what the memory pass recomputes or offloads (set by memory=: a policy name or a function of "
            "passes.memory.policies.Saved answering save, recompute or offload per value)",
            flag=None,
        ),
    )
    precision: Precision | None = field(
        default=None,
        metadata=_help(
            "mixed precision in FSDP2's terms: bf16 (bf16 parameters for compute and all-gathers, fp32 gradient "
            "reduction), bf16-reduce, fp16, or param=bf16,reduce=fp32,output=fp32 (also a torch "
            "MixedPrecisionPolicy); parameters and their gradients stay fp32; None: compute in the model's dtypes",
            metavar="POLICY",
        ),
    )
    capture: str | None = field(
        default=None,
        metadata=_help(
            "capture passes run on dynamo's graph before the backward is traced, e.g. fuse-attention,fold-scans "
            "(pass-debug --list-passes); None: all of them"
        ),
    )
    pipeline: str = field(default=DEFAULT_PIPELINE, metadata=_help("pass pipeline", flag="--pipeline"))
    verify: bool = field(
        default=False,
        metadata=_help(
            "the first step also checks every value on every rank against the single-device model", flag=None
        ),
    )
    backend: str = field(
        default="eager", metadata=_help("how each rank's program runs: eager, inductor, ascend (onnx: export only)")
    )
    trace: Path | None = field(
        default=None,
        metadata=_help(
            "write the predicted timeline of the compiled program (rank 0, compute and comm streams) as a "
            "Chrome/Perfetto trace to FILE",
            metavar="FILE",
        ),
    )
    cache_size: int = field(
        default=DEFAULT_CACHE, metadata=_help("programs a module keeps, one per call signature", flag=None)
    )
    timeout: timedelta | None = field(
        default=None,
        metadata=_help("how long a collective waits for the other ranks (None: the process group's own)", flag=None),
    )
    dynamic: tuple[tuple[int, int], ...] = field(
        default=(),
        metadata=_help(
            "(input index, dim) pairs captured as symbolic sizes: one graph for every value of them", flag=None
        ),
    )
    grad: bool = field(
        default=True,
        metadata=_help("False: a forward-only program, for calls under torch.no_grad() or inference_mode()", flag=None),
    )

    @staticmethod
    def of(**request: Any) -> Options:
        """Read every form a user may write (strings from the shell, dicts from Python) and check
        them together; raises ``PassError`` naming what is wrong and what to write instead. A key
        left out or None takes the field's default."""
        names = [f.name for f in dataclasses.fields(Options) if f.name != "memory_policy"]
        for key in request:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise PassError(f"unknown option {key}={request[key]!r}{hint} Options: {', '.join(names)}")
        given = {k: v for k, v in request.items() if v is not None}
        whole = _mesh_of(given.pop("mesh", None))
        mesh, plan, pp = _pipeline_of(whole, given.pop("plan", None), given.pop("pp", None))
        the_plan = to_plan(plan, mesh) if plan is not None else None
        if the_plan is not None and mesh is None:
            raise PassError(f"plan {the_plan.preset!r} lays values out on a mesh; give a mesh (e.g. dp=2,tp=2)")
        memory = given.pop("memory", None)
        timeout = given.pop("timeout", None)
        options = Options(
            mesh=mesh,
            plan=the_plan,
            moe=_moe_of(given.pop("moe", None)),
            cp=None if "cp" not in given else CpSpec.of(given.pop("cp")),
            pp=pp,
            cluster=_cluster_of(given.pop("cluster", None), whole),
            memory=_memory_bound(memory),
            memory_policy=memory if callable(memory) or memory in MEMORY_POLICIES else None,
            precision=Precision.of(given.pop("precision", None)),
            pipeline=str(PassPipeline.parse(given.pop("pipeline", DEFAULT_PIPELINE))),
            trace=Path(given.pop("trace")) if "trace" in given else None,
            timeout=_timeout_of(timeout),
            **given,
        )
        if options.cache_size < 1:
            raise PassError(f"cache_size must be at least 1 (programs a module keeps), not {options.cache_size}")
        options.check_request()
        return options

    @staticmethod
    def flags() -> list[dataclasses.Field[Any]]:
        """The fields ``pass-debug`` has a flag for, in order."""
        return [f for f in dataclasses.fields(Options) if f.metadata.get("flag") is not None]

    def effective_plan(self) -> Plan | None:
        """The plan the sharding pass follows (None without a mesh): ``plans.effective_plan``."""
        return None if self.mesh is None else effective_plan(self.plan, self.mesh)

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
        plan = self.effective_plan()
        if plan is not None and self.mesh is not None:
            axis_roles(plan, self.mesh)  # NOTE: a bad preset or axis fails here, before the capture
        if self.moe is not None:
            if self.mesh is None or plan is None:
                raise PassError("moe= maps the experts onto a mesh: give a mesh (e.g. dp=2,tp=2)")
            check_spec(plan, self.moe, self.mesh)
            if "moe-fold" not in [p.name for p in passes.passes]:
                raise PassError(f"moe= needs the moe-fold pass, which applies it; pipeline {passes} has none")
        if self.precision is not None and "precision" not in [p.name for p in passes.passes]:
            raise PassError(f"precision= needs the precision pass, which places its casts; pipeline {passes} has none")
        if self.cp is not None and (
            plan is None or self.mesh is None or not sequence_axes(axis_roles(plan, self.mesh))
        ):
            raise PassError(
                "cp= says how attention reads a sequence split over a cp mesh axis; use plan='cp' (or "
                "'cp+tp', 'fsdp+cp') on a mesh with a 'cp' axis"
            )
        return passes


def to_plan(plan: PlanSpec, mesh: Mesh | None) -> Plan:
    """A preset string, a ``Plan``, or a user dict ``{fqn_glob: {axis: "S(d)"|"R"|"P"}}`` with an
    optional ``"preset"`` key (default: the mesh's, ``plans.effective_plan``)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str):
        return Plan.of(plan)
    entries = dict(plan)
    preset = entries.pop("preset", None)
    if preset is None:
        if mesh is None:
            raise PassError("a plan dict without a 'preset' needs a mesh to infer it from")
        preset = effective_plan(None, mesh).preset
    for glob, axes in entries.items():
        if not isinstance(axes, Mapping):
            raise PassError(f"plan entry {glob!r} must map mesh axes to placements, e.g. {{'tp': 'S(0)'}}")
    return Plan.of(str(preset), entries)


def _pipeline_of(
    mesh: Mesh | None, plan: PlanSpec | None, pp: PipelineSpec | Mapping[str, Any] | str | None
) -> tuple[Mesh | None, PlanSpec | None, PipelineSpec | None]:
    """A mesh with a ``pp`` axis pipelines the model over it: the passes see the other axes (a mesh of
    ``pp`` alone: one ``dp`` rank), the plan without its ``pp`` part (``"pp+fsdp"`` -> ``"fsdp"``)."""
    if isinstance(pp, str):
        pp = key_values(pp, "pp", "schedule=1f1b,microbatches=4")
    parts = plan.split("+") if isinstance(plan, str) else []
    if mesh is None or PP not in mesh.names:
        if pp is not None or PP in parts:
            raise PassError(f"pipeline parallelism runs over a mesh axis named {PP!r}; add one (e.g. pp=2,dp=2)")
        return mesh, plan, None
    if "auto" in parts and not (isinstance(pp, Mapping) and "schedule" in pp) and not isinstance(pp, PipelineSpec):
        pp = {**(pp or {}), "schedule": AUTO}  # NOTE: plan="pp+auto" chooses the schedule too
    spec = PipelineSpec.of(pp, mesh.size(PP))
    rest = [(n, s) for n, s in zip(mesh.names, mesh.sizes, strict=True) if n != PP] or [("dp", 1)]
    others = Mesh(tuple(n for n, _ in rest), tuple(s for _, s in rest))
    if isinstance(plan, str):
        plan = "+".join(p for p in parts if p != PP) or None
    return others, plan, spec


def _mesh_of(mesh: Mesh | str | None) -> Mesh | None:
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    try:
        return Mesh.parse(mesh)
    except ValueError as e:
        raise PassError(f"mesh {mesh!r} is malformed: {e}; write e.g. dp=2,tp=2") from None


def _moe_of(moe: MoeSpec | Mapping[str, Any] | str | None) -> MoeSpec | None:
    if moe is None or isinstance(moe, MoeSpec):
        return moe
    try:
        return MoeSpec.of(key_values(moe, "moe", "ep=4,etp=1") if isinstance(moe, str) else moe)
    except TypeError as e:
        raise PassError(f"moe {moe!r}: {e}") from None


def _cluster_of(cluster: Cluster | str | os.PathLike[str] | None, mesh: Mesh | None) -> Cluster | None:
    """Catalog text (``h100:8x1``) or a cluster file's path (``meshfold calibrate --out``), read by
    ``cluster_file.load_cluster``; a file is re-sized to the mesh's ranks (``cluster_file.resize``)."""
    if cluster is None or isinstance(cluster, Cluster):
        return cluster
    text = os.fspath(cluster)
    try:
        return load_cluster(text, None if mesh is None else mesh.world_size)
    except ValueError as e:
        raise PassError(f"cluster {text!r}: {e}") from None


def _timeout_of(timeout: float | timedelta | None) -> timedelta | None:
    """Seconds or a ``timedelta``; raises ``PassError`` for a non-positive one."""
    if timeout is None:
        return None
    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if td.total_seconds() <= 0:
        raise PassError(f"timeout must be positive (seconds or a timedelta), not {timeout!r}")
    return td


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
