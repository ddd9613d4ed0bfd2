"""``meshfold calibrate --from-profile``: refit a cluster's rates from one measured step.

The input is a ``torch.profiler`` Chrome trace recorded with ``record_shapes=True`` (``meshfold
demo`` writes one of rank 0's second step as ``dumps/step-measured.json``). Three kinds of event are
read, each priced by the same formula the planner uses and fitted by ``fitting.solve``:

* matmuls (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``): FLOPs from their input shapes over their
  time refit the GEMM rate per dtype (``device.peak``; the efficiency shape figures stay);
* small ops: top-level aten ops (not inside another aten or collective op) that are not views or
  allocations and read at most ``SMALL_ELEMS`` elements refit ``launch_s``, the fixed per-op cost;
* collectives run by the process group's worker (``gloo:*`` / ``nccl:*`` records, whose span is
  the collective's time on that rank, waiting for peers included): their bytes over their time
  refit ``collective_base_s``, and the link's bandwidth where some are large enough that moving
  their bytes is most of their time (``BANDWIDTH_SHARE``). A trace does not record which group a
  collective ran on; the group size is the most common size among the trace's process groups
  other than the default one (said in the report).

Figures of a kind with no events keep their values. The report says how many events of each kind
the refit used, and the residuals. Times under the profiler include its own per-op overhead (a
few microseconds with shapes recorded), which the small ops' fixed cost absorbs.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshfold.target.cluster_file import ClusterFile
from meshfold.target.hardware import Cluster, Link
from meshfold.tools.calibrate import fitting

SMALL_ELEMS = 4096
"""Input elements up to which an op counts as small (its time is its fixed cost)."""
MATMULS = {"aten::mm": 0, "aten::addmm": 1, "aten::bmm": 0, "aten::baddbmm": 1}
"""Matmul ops and the index of their first matrix operand (after a bias for addmm / baddbmm)."""
NOT_KERNELS = frozenset(
    f"aten::{n}"
    for n in [
        "view",
        "as_strided",
        "reshape",
        "_reshape_alias",
        "_unsafe_view",
        "t",
        "transpose",
        "permute",
        "expand",
        "expand_as",
        "slice",
        "select",
        "detach",
        "alias",
        "unsqueeze",
        "squeeze",
        "narrow",
        "view_as",
        "movedim",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "unfold",
        "flatten",
        "resolve_conj",
        "resolve_neg",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "lift_fresh",
        "result_type",
        "contiguous",
        "is_nonzero",
        "item",
        "_local_scalar_dense",
        "to",
    ]
)
"""Ops that move no data (views, metadata, allocations): not a per-op cost the planner prices."""
ENCLOSING = ("aten::", "_c10d_functional::", "c10d::")
COLLECTIVES = {
    "all_reduce": "all_reduce",
    "allreduce": "all_reduce",
    "all_gather": "all_gather",
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_to_all": "all_to_all",
    "alltoall": "all_to_all",
    "send": "p2p",
    "recv": "p2p",
}
DTYPE_OF = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16"}
ITEM_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1}


@dataclass
class TracePoints:
    """The events of one trace as probe points (``fitting``'s dicts), and what was assumed."""

    gemm: list[dict[str, Any]] = field(default_factory=list)
    small: list[dict[str, Any]] = field(default_factory=list)
    collective: list[dict[str, Any]] = field(default_factory=list)
    group_size: int = 1
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)


def _tensors(args: dict[str, Any]) -> list[tuple[list[int], str]]:
    dims, types = args.get("Input Dims", []), args.get("Input type", [])
    return [
        (d, t)
        for d, t in zip(dims, types, strict=False)
        if isinstance(d, list) and all(isinstance(v, int) for v in d) and t in ITEM_BYTES
    ]


def _top_level(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The aten ops of ``events`` not nested inside another aten or collective op on their thread."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if str(e.get("name", "")).startswith(ENCLOSING):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        end = -math.inf
        for e in evs:
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out


def _group_size(trace: dict[str, Any]) -> int:
    info = trace.get("distributedInfo") or {}
    groups = info.get("pg_config") or []
    sizes = [int(g["pg_size"]) for g in groups if g.get("pg_desc") != "default_pg" and "pg_size" in g]
    if sizes:
        return collections.Counter(sizes).most_common(1)[0][0]
    return int(info.get("world_size", 1))


def read_trace(path: str | Path) -> tuple[TracePoints, dict[str, Any]]:
    """The probe points of the Chrome trace at ``path`` and its ``distributedInfo``; ValueError
    when it is not a trace or was recorded without shapes."""
    p = Path(path)
    try:
        trace = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--from-profile {p}: not a readable Chrome trace ({e})") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"--from-profile {p}: no traceEvents; give a torch.profiler Chrome trace")
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]
    if not any("Input Dims" in e.get("args", {}) for e in spans):
        raise ValueError(
            f"--from-profile {p}: the trace has no input shapes; record it with "
            "torch.profiler.profile(record_shapes=True) (meshfold demo's step-measured.json has them)"
        )
    points = TracePoints(group_size=_group_size(trace))
    for e in spans:
        name = str(e["name"])
        seconds = float(e["dur"]) * 1e-6
        if seconds <= 0:
            continue
        if name in MATMULS:
            _matmul(points, e, MATMULS[name], seconds)
        elif name.split(":", 1)[0] in ("gloo", "nccl") and name.count(":") == 1:
            _collective(points, e, name.split(":", 1)[1], seconds)
    for e in _top_level(spans):
        name = str(e["name"])
        if name in MATMULS or name in NOT_KERNELS or not name.startswith("aten::"):
            continue
        tensors = _tensors(e.get("args", {}))
        elems = sum(math.prod(d) for d, _ in tensors)
        if tensors and elems <= SMALL_ELEMS and e["dur"] > 0:
            nbytes = sum(math.prod(d) * ITEM_BYTES[t] for d, t in tensors)
            points.small.append({"op": name, "bytes": nbytes, "seconds": float(e["dur"]) * 1e-6})
    return points, trace.get("distributedInfo") or {}


def _matmul(points: TracePoints, e: dict[str, Any], first: int, seconds: float) -> None:
    args = e.get("args", {})
    dims, types = args.get("Input Dims", []), args.get("Input type", [])
    if len(dims) < first + 2 or types[first] not in DTYPE_OF:
        points.skipped[f"{e['name']} (no shapes or dtype)"] += 1
        return
    a, b = dims[first], dims[first + 1]
    if len(a) == 2 and len(b) == 2:
        m, k, n = a[0], a[1], b[1]
    elif len(a) == 3 and len(b) == 3:
        m, k, n = a[0] * a[1], a[2], b[2]  # NOTE: a batched matmul as one of batch x m rows
    else:
        points.skipped[f"{e['name']} (shapes {a} {b})"] += 1
        return
    if m * n * k > 0:
        points.gemm.append({"dtype": DTYPE_OF[types[first]], "m": m, "n": n, "k": k, "seconds": seconds})


def _collective(points: TracePoints, e: dict[str, Any], op: str, seconds: float) -> None:
    kind = COLLECTIVES.get(op)
    tensors = _tensors(e.get("args", {}))
    if kind is None or not tensors:
        points.skipped[f"{e['name']} (unknown collective or no shapes)"] += 1
        return
    nbytes = sum(math.prod(d) * ITEM_BYTES[t] for d, t in tensors)
    size = 2 if kind == "p2p" else points.group_size
    if kind == "all_gather":
        nbytes *= size  # NOTE: a rank gives its shard; the model's buffer is the gathered output
    if size > 1 and nbytes > 0:
        points.collective.append({"kind": kind, "size": size, "bytes": nbytes, "seconds": seconds})


def refit(cluster_file: ClusterFile, trace_path: str | Path) -> tuple[ClusterFile, dict[str, Any]]:
    """``cluster_file`` with the rates the trace's events imply (see the module doc); returns the
    new file and the refit's report (events used per kind, residuals before and after)."""
    points, info = read_trace(trace_path)
    cluster = cluster_file.cluster
    dev = cluster.device
    for p in points.collective:
        per = max(1, min(p["size"], cluster.devices_per_node))
        p |= {"per_node": per, "nodes": -(-p["size"] // per)}
    before = _residuals(cluster, points)
    sources = dict(cluster_file.sources)
    note = f"refit from {trace_path}"
    if points.small:
        x = fitting.solve(
            lambda x: fitting.price_memory(fitting.with_figures(dev, launch_s=x[0] * 1e-6)),
            points.small,
            [max(dev.eff.launch_s, 1e-7) * 1e6],
            [0.0],
            [1e5],
        )
        dev = fitting.with_figures(dev, launch_s=x[0] * 1e-6)
        sources["device.efficiency.launch_s"] = f"{note}: {len(points.small)} small ops"
    dtypes = sorted({p["dtype"] for p in points.gemm})
    if dtypes:
        peaks = dict(dev.peak)
        for name in dtypes:
            ours = [p for p in points.gemm if p["dtype"] == name]
            x = fitting.solve(
                lambda x, name=name: fitting.price_gemm(fitting.with_peaks(dev, peaks | {name: math.exp(x[0])})),
                ours,
                [math.log(peaks.get(name, dev.peak[0][1]))],
                [0.0],
                [80.0],
            )
            peaks[name] = math.exp(x[0])
            sources[f"device.peak.{name}"] = f"{note}: {len(ours)} {name} matmuls"
        dev = fitting.with_peaks(dev, peaks)
    cluster = dataclasses.replace(cluster, device=dev)
    bandwidth = False
    if points.collective:
        cluster, bandwidth = _refit_link(cluster, points.collective)
        sources["device.efficiency.collective_base_s"] = f"{note}: {len(points.collective)} collectives"
        if bandwidth:
            sources["intra"] = f"{note}: bw from {len(points.collective)} collectives"
    after = _residuals(cluster, points)
    report = {
        "trace": str(trace_path),
        "rank": info.get("rank"),
        "world_size": info.get("world_size"),
        "events": {"matmul": len(points.gemm), "small op": len(points.small), "collective": len(points.collective)},
        "skipped": dict(points.skipped),
        "assumed_group_size": points.group_size,
        "link_bandwidth_refit": bandwidth,
        "residuals_before": before,
        "residuals_after": after,
    }
    measured = dict(cluster_file.measured)
    if "points" in measured:
        measured["residuals"] = fitting.residuals_of(cluster, measured["points"])
    measured["refit"] = report
    return ClusterFile(cluster, dict(sorted(sources.items())), measured), report


BANDWIDTH_SHARE = 0.5
"""A collective tells the link's bandwidth when moving its bytes is at least this share of its
predicted time; a trace without two such collectives refits the fixed cost only."""


def _refit_link(cluster: Cluster, points: list[dict[str, Any]]) -> tuple[Cluster, bool]:
    """``collective_base_s`` and, where the trace's collectives are large enough to tell it
    (``BANDWIDTH_SHARE``), the intra link's effective bandwidth (its ``efficiency`` kept); returns
    the cluster and whether the bandwidth was refit."""
    intra = cluster.intra
    eff = intra.efficiency
    price = fitting.price_collective(cluster)
    zero = fitting.price_collective(dataclasses.replace(cluster, intra=dataclasses.replace(intra, bw=math.inf)))
    sized = sum(1 for p in points if 1.0 - zero(p) / price(p) >= BANDWIDTH_SHARE)
    with_bw = sized >= 2

    def cluster_of(x: Sequence[float]) -> Cluster:
        dev = fitting.with_figures(cluster.device, collective_base_s=x[0] * 1e-6)
        link = Link(intra.name, math.exp(x[1]) / eff, intra.latency_s, eff) if with_bw else intra
        return dataclasses.replace(cluster, device=dev, intra=link, inter=link if cluster.nodes == 1 else cluster.inter)

    x0, lower, upper = [max(cluster.device.eff.collective_base_s, 1e-7) * 1e6], [0.0], [1e6]
    if with_bw:
        x0, lower, upper = [*x0, math.log(intra.effective_bw)], [*lower, 0.0], [*upper, 60.0]
    fitted = fitting.solve(lambda x: fitting.price_collective(cluster_of(x)), points, x0, lower, upper)
    return cluster_of(fitted), with_bw


def _residuals(cluster: Cluster, points: TracePoints) -> dict[str, Any]:
    dev = cluster.device
    out = {}
    for name, pts, price in (
        ("matmul", points.gemm, fitting.price_gemm(dev)),
        ("small op", points.small, fitting.price_memory(dev)),
        ("collective", points.collective, fitting.price_collective(cluster)),
    ):
        copies = [dict(p) for p in pts]
        out[name] = fitting.annotate(copies, price)
    return out
