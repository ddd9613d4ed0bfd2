"""From measured points to a ``Cluster``: least squares on the time model's own formulas.

Each group of figures is fitted with ``scipy.optimize.least_squares`` on ``log(model / measured)``
(relative error, so a 4 KiB all-reduce counts as much as an 8 MiB one), where the model is the
function the planner prices with -- ``opcost.memory_time``, ``opcost.gemm_time``,
``comm.collective_time`` -- on a device or cluster built from the parameters. So a file's figures
reproduce its measurements as closely as the formulas allow, and the residual it records per point
is what the planner's error on that point is.

What is fitted, in order (each step holds the earlier figures fixed):

1. ``launch_s`` and the streaming rate from the tiny ops and the large copies/adds (``mem_ramp_s``
   is 0: the model cannot tell it from ``launch_s``);
2. per dtype the sustained GEMM rate, and ``gemm_fill_s``, ``gemm_k_half``, ``gemm_mn_half``
   (after the solo split below, ``attn_fwd_max`` and ``attn_bwd_max`` from the attention points);
3. the link's effective bandwidth, its per-step ``latency_s`` and the device's
   ``collective_base_s`` from every collective (world and pairs) and send/recv;
4. ``host_bw`` from the offload+reload round trips.

The rates with every rank busy are then split, physically, into what one rank reaches alone (the
``solo`` points: ``peak``, ``hbm_bw``, the link's ``bw``) and the fraction all ranks at once reach of
it (``gemm_max``, ``mem_max``, the link's ``efficiency``); the products -- all the model reads --
are the fitted rates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from meshfold.passes.cost import comm, opcost
from meshfold.target.cluster_file import ClusterFile
from meshfold.target.hardware import DEVICES, LOCAL, Cluster, Device, Efficiency, Link, device_cluster

METHOD = "scipy.optimize.least_squares (trf) on log(model / measured)"


def solve(
    model: Callable[[Sequence[float]], Callable[[dict[str, Any]], float]],
    points: Sequence[dict[str, Any]],
    x0: Sequence[float],
    lower: Sequence[float],
    upper: Sequence[float],
) -> list[float]:
    """Parameters minimising the squared log ratios of ``model(x)(point)`` to each point's
    ``seconds``; ``model(x)`` builds the pricing function once per parameter vector."""

    def residuals(x: Sequence[float]) -> np.ndarray:
        price = model(x)
        return np.array([math.log(max(price(p), 1e-15) / p["seconds"]) for p in points])

    start = np.clip(np.asarray(x0, dtype=float), lower, upper)
    found = least_squares(residuals, start, bounds=(lower, upper), x_scale="jac", ftol=1e-12, xtol=1e-12, gtol=1e-12)
    return [float(v) for v in found.x]


def base_device(where: dict[str, Any]) -> Device:
    """The catalog device the measured ranks are (figures not measured are carried over from it):
    ``cpu`` for CPU ranks, the catalog part the CUDA driver names, else ``cpu``'s figures renamed."""
    if where.get("device_type", "cpu") == "cpu":
        return DEVICES[LOCAL]
    found = device_cluster(str(where.get("device", "")), 1, 1)
    if found is not None:
        return found.device
    return dataclasses.replace(DEVICES[LOCAL], name=str(where.get("device_type")), vendor="unknown")


def with_figures(dev: Device, **figures: float) -> Device:
    """``dev`` with some figures replaced: ``Efficiency`` fields by name, or ``Device`` fields."""
    eff = {k: v for k, v in figures.items() if k in Efficiency.__slots__}
    top = {k: v for k, v in figures.items() if k not in eff}
    return dataclasses.replace(dev, eff=dataclasses.replace(dev.eff, **eff), **top)


def with_peaks(dev: Device, peaks: dict[str, float]) -> Device:
    """``dev`` with the peak FLOP/s per dtype ``peaks``."""
    return dataclasses.replace(dev, peak=tuple(peaks.items()))


# --- the pricing of each probe, on a device or a cluster ----------------------------------------


def price_memory(dev: Device) -> Callable[[dict[str, Any]], float]:
    """A tiny op or a stream probe as ``opcost.memory_time`` prices one kernel moving its bytes."""
    return lambda p: opcost.memory_time(dev, float(p["bytes"]))


def price_gemm(dev: Device) -> Callable[[dict[str, Any]], float]:
    """A matmul probe as ``opcost.gemm_time`` prices it."""
    return lambda p: opcost.gemm_time(dev, float(p["m"]), float(p["n"]), float(p["k"]), p["dtype"])


def price_attention(dev: Device) -> Callable[[dict[str, Any]], float]:
    """An attention probe as ``opcost.attention_time`` prices one fused causal attention."""

    def price(p: dict[str, Any]) -> float:
        seq, dim = float(p["seq"]), int(p["dim"])
        backward = p["pass"] == "bwd"
        return opcost.attention_time(dev, seq, seq, float(p["heads"]), dim, dim, backward=backward, dtype=p["dtype"])

    return price


def price_collective(cluster: Cluster) -> Callable[[dict[str, Any]], float]:
    """A collective or send/recv probe as ``comm.collective_time`` prices it on its group."""

    def price(p: dict[str, Any]) -> float:
        g = comm.Group(int(p["size"]), int(p["per_node"]), int(p["nodes"]))
        return comm.collective_time(p["kind"], cluster, g, float(p["bytes"]))

    return price


def price_host(dev: Device) -> Callable[[dict[str, Any]], float]:
    """A host round trip as the schedule prices moving its bytes to and from the host tier."""
    return lambda p: float(p["bytes"]) / dev.host_bw


# --- the fits -----------------------------------------------------------------------------------


def fit_memory(dev: Device, launch: list[dict[str, Any]], stream: list[dict[str, Any]]) -> Device:
    """``launch_s`` and the streaming rate (as ``hbm_bw`` with ``mem_max`` 1). ``mem_ramp_s`` is set
    to 0: in ``memory_time`` a ramp adds ``mem_ramp_s`` to every kernel, exactly as ``launch_s`` does,
    so the points cannot tell the two apart; the fixed cost is all in ``launch_s``."""
    points = launch + stream
    rate0 = max(p["bytes"] / p["seconds"] for p in stream) if stream else dev.hbm_bw
    launch0 = min(p["seconds"] for p in launch) if launch else dev.eff.launch_s

    def device_of(x: Sequence[float]) -> Device:
        return with_figures(dev, hbm_bw=math.exp(x[0]), mem_max=1.0, mem_ramp_s=0.0, launch_s=x[1] * 1e-6)

    x = solve(lambda x: price_memory(device_of(x)), points, [math.log(rate0), launch0 * 1e6], [0.0, 0.0], [60.0, 1e5])
    return device_of(x)


def fit_gemm(dev: Device, gemm: list[dict[str, Any]]) -> Device:
    """Per dtype the sustained rate (as ``peak`` with ``gemm_max`` 1), ``gemm_fill_s``,
    ``gemm_k_half`` and ``gemm_mn_half``."""
    dtypes = sorted({p["dtype"] for p in gemm}, key=lambda d: ("fp32", "bf16", "fp16").index(d))
    rate0 = [max(2 * p["m"] * p["n"] * p["k"] / p["seconds"] for p in gemm if p["dtype"] == d) for d in dtypes]

    def device_of(x: Sequence[float]) -> Device:
        peaks = dict(zip(dtypes, (math.exp(v) for v in x[: len(dtypes)]), strict=True))
        fill, k_half, mn_half = x[len(dtypes) :]
        return with_figures(
            with_peaks(dev, peaks),
            gemm_max=1.0,
            gemm_fill_s=fill * 1e-6,
            gemm_k_half=k_half,
            gemm_mn_half=mn_half * 1e3,
        )

    x0 = [*map(math.log, rate0), 1.0, 8.0, 1.0]
    lower = [0.0] * len(dtypes) + [0.0, 0.0, 0.0]
    upper = [80.0] * len(dtypes) + [1e5, 1e5, 1e6]
    return device_of(solve(lambda x: price_gemm(device_of(x)), gemm, x0, lower, upper))


def fit_attention(dev: Device, attention: list[dict[str, Any]]) -> Device:
    """``attn_fwd_max`` and ``attn_bwd_max``: the fractions of the dtype's peak the forward and the
    backward of attention reach (on the FLOPs ``opcost.attention_time`` counts), each fitted to its
    own points; a pass with no points keeps ``gemm_max``."""
    figures = {}
    for name, which in (("attn_fwd_max", "fwd"), ("attn_bwd_max", "bwd")):
        points = [p for p in attention if p["pass"] == which]
        if not points:
            figures[name] = dev.eff.gemm_max
            continue

        def device_of(x: Sequence[float], name: str = name) -> Device:
            return with_figures(dev, **{name: x[0]})

        x = solve(lambda x, d=device_of: price_attention(d(x)), points, [dev.eff.gemm_max], [1e-6], [1.0])
        figures[name] = x[0]
    return with_figures(dev, **figures)


def _cluster(dev: Device, per_node: int, nodes: int, intra: Link, inter: Link) -> Cluster:
    return Cluster(dev, per_node, nodes, intra, inter, per_node if nodes > 1 else 1)


def fit_links(
    dev: Device, per_node: int, nodes: int, points: list[dict[str, Any]], name: str, base: Cluster
) -> Cluster:
    """The intra link's effective bandwidth and latency, ``collective_base_s``, and where the
    points cross nodes the inter link's too (both with ``efficiency`` 1)."""
    spans = any(p["nodes"] > 1 for p in points)

    def cluster_of(x: Sequence[float]) -> Cluster:
        d = with_figures(dev, collective_base_s=x[2] * 1e-6)
        intra = Link(name, math.exp(x[0]), x[1] * 1e-6, 1.0)
        inter = Link(name, math.exp(x[3]), x[4] * 1e-6, 1.0) if spans else intra
        return _cluster(d, per_node, nodes, intra, inter)

    if not points:
        return _cluster(dev, per_node, nodes, base.intra, base.inter)
    bw0 = max(p["bytes"] / p["seconds"] for p in points)
    base0 = min(p["seconds"] for p in points) * 1e6
    x0, lower, upper = [math.log(bw0), 1.0, base0], [0.0, 0.0, 0.0], [60.0, 1e6, 1e6]
    if spans:
        x0, lower, upper = [*x0, math.log(bw0), 1.0], [*lower, 0.0, 0.0], [*upper, 60.0, 1e6]
    return cluster_of(solve(lambda x: price_collective(cluster_of(x)), points, x0, lower, upper))


def fit_host(dev: Device, host: list[dict[str, Any]]) -> Device:
    """``host_bw`` from the offload+reload round trips."""
    if not host:
        return dev
    x0 = [math.log(max(p["bytes"] / p["seconds"] for p in host))]
    x = solve(lambda x: price_host(dataclasses.replace(dev, host_bw=math.exp(x[0]))), host, x0, [0.0], [60.0])
    return dataclasses.replace(dev, host_bw=math.exp(x[0]))


# --- rates alone vs all ranks at once -----------------------------------------------------------


def _split(busy: float, alone: float | None) -> tuple[float, float]:
    """(rate one rank reaches alone, fraction of it every rank at once reaches): the fraction is at
    most 1 (a noisy solo point slower than the busy fit leaves the busy rate as the device's)."""
    if alone is None or alone <= busy:
        return busy, 1.0
    return alone, busy / alone


def split_solo(cluster: Cluster, solo: dict[str, Any], base: Device) -> tuple[Cluster, dict[str, str]]:
    """Split the fitted busy rates with the solo points; returns the cluster and each figure's source."""
    dev = cluster.device
    src: dict[str, str] = {}
    ratios = []
    for p in solo.get("gemm", []):
        alone = 2 * p["m"] * p["n"] * p["k"] / p["seconds"]
        ratios.append(min(1.0, dev.peak_flops(p["dtype"]) / alone))
    gemm_max = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 1.0
    peaks = {name: flops / gemm_max for name, flops in dev.peak}
    for name in peaks:
        src[f"device.peak.{name}"] = "measured: rank 0 alone on the largest square matmul, fitted with every rank busy"
    stream = solo.get("stream")
    hbm_bw, mem_max = _split(dev.hbm_bw, stream["bytes"] / stream["seconds"] if stream else None)
    figures: dict[str, float] = {"gemm_max": gemm_max, "mem_max": mem_max}
    if base.name == LOCAL and not solo.get("attention"):
        # NOTE: without attention points (a file written before they were measured) attention on
        # CPU ranks is priced at the matmul rate
        figures |= {"attn_fwd_max": gemm_max, "attn_bwd_max": gemm_max}
        src["device.efficiency.attn_fwd_max"] = src["device.efficiency.attn_bwd_max"] = "set to gemm_max: not measured"
    dev = with_figures(with_peaks(dev, peaks), hbm_bw=hbm_bw, **figures)
    intra = cluster.intra
    p2p = solo.get("p2p")
    if p2p is not None and intra.efficiency == 1.0:
        floor = intra.latency_s + dev.eff.collective_base_s
        alone = p2p["bytes"] / (p2p["seconds"] - floor) if p2p["seconds"] > floor * 1.05 else None
        bw, eff = _split(intra.bw, alone)
        intra = Link(intra.name, bw, intra.latency_s, eff)
    inter = intra if cluster.nodes == 1 else cluster.inter
    return dataclasses.replace(cluster, device=dev, intra=intra, inter=inter), src


# --- the whole calibration ----------------------------------------------------------------------


def annotate(points: list[dict[str, Any]], price: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    """Each point gets ``fitted_s`` and ``residual`` (fitted / measured - 1); returns the summary:
    rms and max of the residuals, and ``rms_log``, the rms of log(fitted / measured) the fits minimise."""
    res, logs = [], []
    for p in points:
        p["fitted_s"] = price(p)
        p["residual"] = p["fitted_s"] / p["seconds"] - 1.0
        res.append(p["residual"])
        logs.append(math.log(max(p["fitted_s"], 1e-15) / p["seconds"]))
    if not res:
        return {"points": 0}
    return {
        "points": len(res),
        "rms": math.sqrt(sum(r * r for r in res) / len(res)),
        "max": max(map(abs, res)),
        "rms_log": math.sqrt(sum(r * r for r in logs) / len(logs)),
    }


def residuals_of(cluster: Cluster, points: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Fitted times and residuals of every probe point on ``cluster`` (written into ``points``)."""
    dev = cluster.device
    return {
        "launch": annotate(points.get("launch", []), price_memory(dev)),
        "stream": annotate(points.get("stream", []), price_memory(dev)),
        "gemm": annotate(points.get("gemm", []), price_gemm(dev)),
        "attention": annotate(points.get("attention", []), price_attention(dev)),
        "collective": annotate(points.get("collective", []), price_collective(cluster)),
        "host": annotate(points.get("host", []), price_host(dev)),
    }


def fit(record: dict[str, Any]) -> ClusterFile:
    """The cluster file of one calibration ``record`` (``probes.measure``'s): every fit above,
    the solo split, the residuals of every point, and which figures came from where."""
    where, points = record["where"], record["points"]
    world = int(where["world_size"])
    per_node = max(1, min(int(where.get("local_world_size", world)), world))
    nodes = -(-world // per_node)
    base = base_device(where)
    if where.get("memory_bytes"):
        base = dataclasses.replace(base, hbm_bytes=float(where["memory_bytes"]))
    dev = fit_memory(base, points["launch"], points["stream"])
    dev = fit_gemm(dev, points["gemm"])
    dev = fit_host(dev, points["host"])
    catalog = _cluster(base, per_node, nodes, *_catalog_links(base))
    link_name = str(where.get("backend", "gloo"))
    cluster = fit_links(dev, per_node, nodes, points["collective"], link_name, catalog)
    solo = points["solo"] | {"attention": bool(points.get("attention"))}
    cluster, sources = split_solo(cluster, solo, base)
    if points.get("attention"):  # NOTE: after the split: the fractions are of the peak it sets
        cluster = dataclasses.replace(cluster, device=fit_attention(cluster.device, points["attention"]))
        for name in ("attn_fwd_max", "attn_bwd_max"):
            sources[f"device.efficiency.{name}"] = "measured: fitted to causal attention points with every rank busy"
    sources = _sources(base, bool(points["collective"]), nodes > 1) | sources
    summary = residuals_of(cluster, points)
    measured = {
        "where": where,
        "method": METHOD,
        "residuals": summary,
        "points": points,
    }
    return ClusterFile(cluster, dict(sorted(sources.items())), measured)


def _catalog_links(base: Device) -> tuple[Link, Link]:
    from meshfold.target.hardware import DEFAULT_FABRIC, link

    intra, inter, _ = DEFAULT_FABRIC.get(base.name, DEFAULT_FABRIC[LOCAL])
    return link(intra), link(inter)


def _sources(base: Device, comm_measured: bool, spans: bool) -> dict[str, str]:
    fitted = "measured: fitted to the probe points with every rank busy"
    out = {
        "device.efficiency.launch_s": fitted + " (tiny ops)",
        "device.efficiency.mem_ramp_s": "set to 0: priced like launch_s, which holds the fixed cost",
        "device.hbm_bw": "measured: rank 0 alone on the largest copy (or the busy fit where faster)",
        "device.efficiency.mem_max": "measured: busy streaming rate over device.hbm_bw",
        "device.efficiency.gemm_max": "measured: busy matmul rate over device.peak",
        "device.efficiency.gemm_fill_s": fitted + " (matmuls)",
        "device.efficiency.gemm_k_half": fitted + " (matmuls)",
        "device.efficiency.gemm_mn_half": fitted + " (matmuls)",
        "device.host_bw": fitted + " (mem.offload + mem.reload round trips)",
        "device.efficiency.contention": f"catalog {base.name}: not measured",
        "device.hbm_bytes": f"catalog {base.name}" if math.isinf(base.hbm_bytes) else "the device's total memory",
    }
    for name in ("attn_fwd_max", "attn_bwd_max"):
        out.setdefault(f"device.efficiency.{name}", f"catalog {base.name}: not measured")
    if comm_measured:
        out |= {
            "device.efficiency.collective_base_s": fitted + " (collectives)",
            "intra": fitted + " (collectives); bw from rank 0 sending alone",
            "inter": fitted + " (collectives across nodes)" if spans else "the intra link (one node)",
        }
    else:
        out |= {
            "device.efficiency.collective_base_s": f"catalog {base.name}: one rank, no collective to measure",
            "intra": f"catalog {base.name}: one rank, no collective to measure",
            "inter": f"catalog {base.name}: one rank, no collective to measure",
        }
    return out
