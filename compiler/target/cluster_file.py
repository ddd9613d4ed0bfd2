"""Cluster files: a ``Cluster`` as plain JSON, written by ``meshfold calibrate`` from what it measured.

A file holds every figure the time model reads (the device's peak per dtype, memory and host
bandwidth, every ``Efficiency`` field; nodes, devices per node, the intra- and inter-node links)
beside a free-form ``measured`` record of where, when and how the figures were obtained (raw
points, fitted times, residuals) and ``sources``: for each figure, whether it was measured or
carried over from the catalog. Reading one is plain ``json`` and field-by-field checks: a wrong or
missing field raises ValueError naming the field and the file; nothing in a file is ever executed.
Writing is atomic (a temporary file renamed into place), so a reader never sees half a file.

``load_cluster`` is THE reader of what a user writes for ``cluster=``: the catalog text
(``h100:8x64``) or a path to such a file, optionally re-sized for a world of ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshfold.target.hardware import Cluster, Device, Efficiency, Link, parse_cluster

FORMAT = "meshfold-cluster"
VERSION = 1
EFFICIENCY_FIELDS = tuple(f.name for f in dataclasses.fields(Efficiency))
LINK_FIELDS = ("name", "bw", "latency_s", "efficiency")
TOP_FIELDS: tuple[str, ...] = ("format", "version", "device", "devices_per_node", "nodes", "nics_per_node")
TOP_FIELDS += ("intra", "inter", "sources", "measured")


@dataclass(frozen=True)
class ClusterFile:
    """A cluster file's contents: the ``cluster``, where each figure came from (``sources``: figure
    path such as ``device.peak.fp32`` -> ``measured ...`` or ``catalog ...``), and the ``measured``
    record (raw points, fits, residuals, host, torch version, world size)."""

    cluster: Cluster
    sources: dict[str, str] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)


def is_cluster_path(text: str) -> bool:
    """True when ``cluster=`` text names a file rather than the catalog: it ends in ``.json`` or is
    an existing path."""
    return text.strip().endswith(".json") or Path(text).is_file()


def load_cluster(text: str, world: int | None = None) -> Cluster:
    """The cluster ``text`` names: a cluster file (``is_cluster_path``) or catalog text such as
    ``h100:8x64`` (``parse_cluster``). ``world``, when given, is the rank count the caller's mesh
    has; a file measured on another rank count is re-sized for it (``resize``). Raises ValueError
    naming the file and field, or the bad part of the text."""
    if not is_cluster_path(text):
        return parse_cluster(text)
    cluster = read_cluster_file(text).cluster
    return cluster if world is None else resize(cluster, world, source=text)


def resize(cluster: Cluster, world: int, *, source: str = "cluster") -> Cluster:
    """``cluster`` with ``world`` ranks: a one-node cluster grows or shrinks its node (a calibrated
    host priced for another rank count keeps its measured per-rank figures, which is an
    extrapolation: calibrate on the rank count you plan for); a multi-node cluster keeps its
    devices per node and changes the node count, and refuses a world it cannot divide."""
    if world < 1:
        raise ValueError(f"{source}: a cluster needs at least one rank, not {world}")
    if world == cluster.world_size:
        return cluster
    if cluster.nodes == 1:
        # NOTE: NICs scale with the devices of a node, as ``make_cluster`` scales them
        nics = max(1, cluster.nics_per_node * world // cluster.devices_per_node)
        return dataclasses.replace(cluster, devices_per_node=world, nics_per_node=nics, groups=())
    per = cluster.devices_per_node
    if world % per:
        raise ValueError(
            f"{source}: a mesh of {world} ranks does not fill nodes of {per} devices "
            f"({cluster.nodes} nodes were calibrated); use a multiple of {per} ranks or recalibrate"
        )
    return dataclasses.replace(cluster, nodes=world // per, groups=())


# --- writing ------------------------------------------------------------------------------------


def _link_dict(link: Link) -> dict[str, Any]:
    return {"name": link.name, "bw": link.bw, "latency_s": link.latency_s, "efficiency": link.efficiency}


def cluster_dict(cluster: Cluster) -> dict[str, Any]:
    """The JSON object of ``cluster`` (without ``sources`` and ``measured``); an unbounded memory
    (``math.inf``, the host CPU's) is written as null."""
    if cluster.groups:
        raise ValueError(f"cluster {cluster}: node groups with different NICs have no file form; write one group")
    dev = cluster.device
    return {
        "format": FORMAT,
        "version": VERSION,
        "device": {
            "name": dev.name,
            "vendor": dev.vendor,
            "peak": dict(dev.peak),
            "hbm_bytes": None if math.isinf(dev.hbm_bytes) else dev.hbm_bytes,
            "hbm_bw": dev.hbm_bw,
            "host_bw": dev.host_bw,
            "efficiency": {name: getattr(dev.eff, name) for name in EFFICIENCY_FIELDS},
        },
        "devices_per_node": cluster.devices_per_node,
        "nodes": cluster.nodes,
        "nics_per_node": cluster.nics_per_node,
        "intra": _link_dict(cluster.intra),
        "inter": _link_dict(cluster.inter),
    }


def write_cluster_file(path: str | Path, contents: ClusterFile) -> Path:
    """Write ``contents`` to ``path`` whole or not at all (a temporary file beside it renamed into
    place); returns the path."""
    out = Path(path)
    data = cluster_dict(contents.cluster) | {"sources": contents.sources, "measured": contents.measured}
    text = json.dumps(data, indent=1, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(dir=out.parent if str(out.parent) else ".", prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


# --- reading ------------------------------------------------------------------------------------


class _Reader:
    """Field checks that name the file and the field's path (``device.efficiency.gemm_max``)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> ValueError:
        return ValueError(
            f"cluster file {self.source}: field {where} {what}; rewrite it with `meshfold calibrate` or fix that field"
        )

    def obj(self, data: Any, where: str) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise self.fail(where, f"must be a JSON object, not {type(data).__name__}")
        return data

    def get(self, data: dict[str, Any], key: str, where: str) -> Any:
        if key not in data:
            raise self.fail(f"{where}{key}", "is missing")
        return data[key]

    def text(self, data: dict[str, Any], key: str, where: str) -> str:
        value = self.get(data, key, where)
        if not isinstance(value, str) or not value:
            raise self.fail(f"{where}{key}", f"must be a non-empty string, not {value!r}")
        return value

    def number(self, data: dict[str, Any], key: str, where: str, *, low: float = 0.0, positive: bool = False) -> float:
        value = self.get(data, key, where)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(f"{where}{key}", f"must be a finite number, not {value!r}")
        if value < low or (positive and value <= 0):
            bound = "> 0" if positive else f">= {low}"
            raise self.fail(f"{where}{key}", f"must be {bound}, not {value!r}")
        return float(value)

    def count(self, data: dict[str, Any], key: str, where: str) -> int:
        value = self.get(data, key, where)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(f"{where}{key}", f"must be a positive integer, not {value!r}")
        return value

    def link(self, data: dict[str, Any], key: str) -> Link:
        obj = self.obj(self.get(data, key, ""), key)
        self.known(obj, LINK_FIELDS, f"{key}.")
        efficiency = self.number(obj, "efficiency", f"{key}.", positive=True)
        if efficiency > 1.0:
            raise self.fail(
                f"{key}.efficiency", f"is a fraction of the link's bw and must be in (0, 1], not {efficiency}"
            )
        return Link(
            self.text(obj, "name", f"{key}."),
            self.number(obj, "bw", f"{key}.", positive=True),
            self.number(obj, "latency_s", f"{key}."),
            efficiency,
        )

    def known(self, obj: dict[str, Any], names: tuple[str, ...], where: str) -> None:
        extra = sorted(set(obj) - set(names))
        if extra:
            raise self.fail(f"{where}{extra[0]}", f"is not a cluster file field (expected {', '.join(names)})")


def cluster_from_dict(data: Any, source: str = "<cluster>") -> ClusterFile:
    """Check the JSON object ``data`` field by field and build its ``ClusterFile``; ValueError names
    ``source`` and the first bad field."""
    r = _Reader(source)
    top = r.obj(data, "(top level)")
    if top.get("format") != FORMAT:
        raise r.fail("format", f"must be {FORMAT!r}, not {top.get('format')!r}: this is not a cluster file")
    if top.get("version") != VERSION:
        raise r.fail("version", f"must be {VERSION}, not {top.get('version')!r}")
    r.known(top, TOP_FIELDS, "")
    dev = r.obj(r.get(top, "device", ""), "device")
    r.known(dev, ("name", "vendor", "peak", "hbm_bytes", "hbm_bw", "host_bw", "efficiency"), "device.")
    peak = r.obj(r.get(dev, "peak", "device."), "device.peak")
    if not peak:
        raise r.fail("device.peak", 'must name at least one dtype\'s FLOP/s, e.g. {"fp32": 1e10}')
    peaks = tuple((str(name), r.number(peak, name, "device.peak.", positive=True)) for name in peak)
    eff = r.obj(r.get(dev, "efficiency", "device."), "device.efficiency")
    r.known(eff, EFFICIENCY_FIELDS, "device.efficiency.")
    figures = {name: r.number(eff, name, "device.efficiency.") for name in EFFICIENCY_FIELDS}
    for name in ("gemm_max", "attn_fwd_max", "attn_bwd_max", "mem_max"):
        if not 0.0 < figures[name] <= 1.0:
            raise r.fail(
                f"device.efficiency.{name}", f"is a fraction of peak and must be in (0, 1], not {figures[name]}"
            )
    hbm = r.get(dev, "hbm_bytes", "device.")
    device = Device(
        r.text(dev, "name", "device."),
        r.text(dev, "vendor", "device."),
        peaks,
        math.inf if hbm is None else r.number(dev, "hbm_bytes", "device.", positive=True),
        r.number(dev, "hbm_bw", "device.", positive=True),
        Efficiency(**figures),
        r.number(dev, "host_bw", "device.", positive=True),
    )
    sources = r.obj(top.get("sources", {}), "sources")
    if not all(isinstance(v, str) for v in sources.values()):
        raise r.fail("sources", "must map each figure to a string saying where it came from")
    measured = r.obj(top.get("measured", {}), "measured")
    cluster = Cluster(
        device,
        r.count(top, "devices_per_node", ""),
        r.count(top, "nodes", ""),
        r.link(top, "intra"),
        r.link(top, "inter"),
        r.count(top, "nics_per_node", ""),
    )
    return ClusterFile(cluster, dict(sources), measured)


def read_cluster_file(path: str | Path) -> ClusterFile:
    """Read and check the cluster file at ``path`` (plain JSON); ValueError names the file and what
    is wrong (no such file, not JSON, or the first bad field)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(
            f"cluster file {p}: cannot be read ({e.strerror or e}); write one with `meshfold calibrate --out {p}`"
        ) from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"cluster file {p}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except ValueError as e:
        raise ValueError(f"cluster file {p}: {e}") from None
    return cluster_from_dict(data, str(p))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a cluster file may hold (write finite numbers; null for no bound)")
