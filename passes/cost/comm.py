"""Collective times on a two-level cluster (alpha-beta costs per link level).

A group of ``n = per_node * nodes`` ranks is placed by mesh axis order: the innermost axis gets
contiguous ranks, so it is the one that stays inside a node. Inside a node every rank has the
intra link's bandwidth to the node fabric (NVSwitch / HCCS / UB are non-blocking); across nodes
every rank gets its share of the node's NICs (all ranks of a node communicate at once in SPMD
training), so a group with ``per_node`` members per node has ``per_node`` rank-shares of NICs.

A group that spans nodes runs hierarchically: the intra-node phase on the full buffer and the
inter-node phase on ``1/per_node`` of it. NCCL/HCCL pipeline chunks through both phases, so the
slower phase bounds the transfer; latencies of both phases add. ``nbytes`` is always the FULL
logical buffer: the gathered output of an all-gather, the input of a reduce-scatter or all-reduce,
everything one rank sends in an all-to-all, the message of a send/recv.

On a cluster of node groups with different NICs (``Cluster.groups``) a collective runs as fast as
the slowest NIC among the nodes its members sit on: ``instance_view`` gives the cluster one
instance of a group sees (the dp group of pipeline stage ``r``, say), ``hop`` the two ends of one
pipeline send.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshfold.target.hardware import Cluster

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True, slots=True)
class Group:
    """Where one communication group sits: ``per_node`` members on each of ``nodes`` nodes."""

    size: int
    per_node: int
    nodes: int

    @property
    def spans_nodes(self) -> bool:
        """True when the group crosses node boundaries (uses NICs)."""
        return self.nodes > 1


def place_axes(cluster: Cluster, axes: Sequence[tuple[str, int]], names: Sequence[str]) -> Group:
    """Group spanned by the mesh axes ``names`` (jointly) when ``axes`` (name, size) are ordered
    innermost first and ranks fill nodes contiguously: it counts the members that share rank 0's
    node. Raises KeyError naming the mesh axes when a name is missing."""
    return _place(cluster, tuple((n, s) for n, s in axes), tuple(names))


@functools.lru_cache(maxsize=8192)
def _place(cluster: Cluster, axes: tuple[tuple[str, int], ...], names: tuple[str, ...]) -> Group:
    """``place_axes`` on hashable arguments (the search places the same groups many times)."""
    strides: dict[str, int] = {}
    sizes: dict[str, int] = {}
    stride = 1
    for name, size in axes:
        strides[name], sizes[name] = stride, size
        stride *= size
    missing = [n for n in names if n not in strides]
    if missing:
        raise KeyError(f"axes {missing} are not in mesh order {[n for n, _ in axes]}")
    dpn = cluster.devices_per_node
    size = math.prod(sizes[n] for n in names)
    # NOTE: only axes with stride < devices_per_node can put two members on one node.
    offsets = [0]
    for n in sorted(names, key=lambda a: strides[a]):
        if strides[n] >= dpn:
            continue
        span = sizes[n] * strides[n]
        reach = min(sizes[n], math.ceil(dpn / strides[n]))
        if span % dpn and dpn % span:
            # NOTE: groups that do not tile the node straddle node boundaries; the worst one keeps
            # only gcd(span, dpn) / stride members together.
            reach = max(1, math.gcd(span, dpn) // strides[n])
        offsets = [o + c * strides[n] for o in offsets for c in range(reach) if o + c * strides[n] < dpn]
    per_node = max(1, min(size, len(offsets)))
    return Group(size, per_node, math.ceil(size / per_node))


def _strides(axes: tuple[tuple[str, int], ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    stride = 1
    for name, size in axes:
        out[name] = stride
        stride *= size
    return out


@functools.lru_cache(maxsize=8192)
def instance_view(
    cluster: Cluster, axes: tuple[tuple[str, int], ...], names: tuple[str, ...], fixed: tuple[tuple[str, int], ...]
) -> Cluster:
    """The cluster as the group over mesh axes ``names`` sees it in the instance whose coordinates on
    the other axes are ``fixed`` ((axis, coordinate) pairs; 0 on axes not named): ``Cluster.view`` of
    the node groups its members sit on. A cluster with one kind of NIC is returned as it is."""
    if not cluster.heterogeneous:
        return cluster
    strides, sizes = _strides(axes), dict(axes)
    base = sum(c * strides[a] for a, c in fixed)
    dpn = cluster.devices_per_node
    ranges = [range(0, sizes[n] * strides[n], strides[n]) for n in names if n in sizes]
    groups = frozenset(cluster.group_of_node((base + sum(offs)) // dpn) for offs in itertools.product(*ranges))
    return cluster.view(groups)


def hop(cluster: Cluster, axes: tuple[tuple[str, int], ...], axis: str, i: int) -> tuple[Cluster, bool]:
    """(cluster view, crosses nodes) of the send from coordinate ``i`` to ``i + 1`` of mesh ``axis``
    (coordinates 0 on the other axes): a send between node groups runs at the slower NIC."""
    stride = _strides(axes)[axis]
    dpn = cluster.devices_per_node
    a, b = i * stride // dpn, (i + 1) * stride // dpn
    return cluster.view(frozenset({cluster.group_of_node(a), cluster.group_of_node(b)})), a != b


def place_axis(cluster: Cluster, axes: Sequence[tuple[str, int]], axis: str) -> Group:
    """Group of the single mesh axis ``axis``; see ``place_axes``."""
    return place_axes(cluster, axes, (axis,))


def local_group(size: int) -> Group:
    """A group that fits on one node (used for tests and single-node reasoning)."""
    return Group(size, size, 1)


def _phases(
    cluster: Cluster, g: Group, intra_bytes: float, inter_bytes: float, steps_intra: int, steps_inter: int
) -> float:
    t_intra = intra_bytes / cluster.intra.effective_bw if intra_bytes > 0 else 0.0
    t_inter = inter_bytes / cluster.inter_bw_per_device if inter_bytes > 0 else 0.0
    lat = steps_intra * cluster.intra.latency_s + steps_inter * cluster.inter.latency_s
    return max(t_intra, t_inter) + lat + cluster.device.eff.collective_base_s


def reduce_scatter(cluster: Cluster, g: Group, nbytes: float) -> float:
    """Ring reduce-scatter of an ``nbytes`` input: each rank sends ``(n-1)/n`` of it; spanning
    nodes, ``(k-1)/k`` of it inside the node and ``(m-1)/m`` of the ``1/k`` slice across."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    k, m = g.per_node, g.nodes
    if m == 1:
        return _phases(cluster, g, (k - 1) / k * nbytes, 0.0, k - 1, 0)
    return _phases(cluster, g, (k - 1) / k * nbytes, (m - 1) / m * nbytes / k, k - 1, m - 1)


def all_gather(cluster: Cluster, g: Group, nbytes: float) -> float:
    """Ring all-gather producing an ``nbytes`` output: the mirror image of reduce-scatter."""
    return reduce_scatter(cluster, g, nbytes)


def all_reduce(cluster: Cluster, g: Group, nbytes: float, algo: str = "auto") -> float:
    """All-reduce of ``nbytes`` by ``algo``: "ring" = reduce-scatter + all-gather, i.e.
    ``2 (n-1)/n * nbytes / bw``; "tree" = NCCL's double binary tree across nodes (chain inside):
    ``2 * nbytes / bw`` but only ``log2`` latency steps; "auto" takes the faster, as NCCL's tuner
    does. Raises ValueError on an unknown algorithm."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    if algo not in ("auto", "ring", "tree"):
        raise ValueError(f"unknown all-reduce algorithm {algo!r}; use ring, tree or auto")
    base = cluster.device.eff.collective_base_s
    ring = 2 * reduce_scatter(cluster, g, nbytes) - base
    if algo == "ring":
        return ring
    k, m = g.per_node, g.nodes
    t_intra = 2 * nbytes / cluster.intra.effective_bw if k > 1 else 0.0
    t_inter = 2 * nbytes / (k * cluster.inter_bw_per_device) if m > 1 else 0.0
    lat = (
        2 * ((k - 1) * cluster.intra.latency_s + math.ceil(math.log2(m)) * cluster.inter.latency_s)
        if m > 1
        else 2 * (k - 1) * cluster.intra.latency_s
    )
    tree = max(t_intra, t_inter) + lat + base
    return tree if algo == "tree" else min(ring, tree)


def all_to_all(cluster: Cluster, g: Group, nbytes: float) -> float:
    """All-to-all where each rank sends ``nbytes`` in total, ``1/n`` to every member (itself
    included): ``(k-1)/n`` of it crosses the intra link and ``(n-k)/n`` leaves the node."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    n, k = g.size, g.per_node
    return _phases(cluster, g, (k - 1) / n * nbytes, (n - k) / n * nbytes, 1, 1 if g.nodes > 1 else 0)


def p2p(cluster: Cluster, nbytes: float, *, cross_node: bool) -> float:
    """One send/recv of ``nbytes`` between neighbours, inside a node or across nodes."""
    if nbytes <= 0:
        return 0.0
    if cross_node:
        return nbytes / cluster.inter_bw_per_device + cluster.inter.latency_s + cluster.device.eff.collective_base_s
    return nbytes / cluster.intra.effective_bw + cluster.intra.latency_s + cluster.device.eff.collective_base_s


def collective_time(kind: str, cluster: Cluster, g: Group, nbytes: float, algo: str = "auto") -> float:
    """Dispatch on ``kind`` (one of KINDS); p2p crosses nodes when the group does."""
    if kind == "all_reduce":
        return all_reduce(cluster, g, nbytes, algo)
    if kind == "all_gather":
        return all_gather(cluster, g, nbytes)
    if kind == "reduce_scatter":
        return reduce_scatter(cluster, g, nbytes)
    if kind == "all_to_all":
        return all_to_all(cluster, g, nbytes)
    if kind == "p2p":
        return p2p(cluster, nbytes, cross_node=g.spans_nodes)
    raise ValueError(f"unknown collective {kind!r}; kinds: {', '.join(KINDS)}")
