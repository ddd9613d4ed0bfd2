"""Hardware catalog: accelerators, links and two-level clusters, as frozen plain data.

Every figure carries its source. Peak FLOP/s are *dense* (no 2:4 sparsity); bandwidths are bytes
per second in ONE direction. The ``Efficiency`` block of a device holds the few physical constants
the roofline in ``opcost`` needs (achievable fractions, fixed kernel overheads); they describe the
device, never a particular benchmark row. Figures measured on the ranks a plan is for live in
cluster files (``cluster_file``, written by ``meshfold calibrate``), not here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

LOCAL = "cpu"
"""The catalog device meaning "gloo ranks on this CPU": what a compile without a cluster runs on."""

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

TB = 1e12
GB = 1e9
GIB = 2**30


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Achievable fractions of peak and fixed per-kernel times of one device family.

    ``gemm_max``: sustained fraction of dense peak for large GEMMs (power/clock limited, not
    tile-limited). ``gemm_k_half``: reduction depth at which per-tile prologue/epilogue would halve
    the efficiency (a tile's epilogue costs about that many K steps). ``gemm_mn_half``: output
    elements (M*N) at which the partly empty last wave of tiles would halve it (half a wave of
    tiles on average). ``gemm_fill_s``: pipeline fill/drain of one kernel, paid once per GEMM.
    ``attn_fwd_max`` / ``attn_bwd_max``: fused (flash) attention fraction of peak on the FLOPs it
    really executes. ``mem_max``: fraction of HBM bandwidth a streaming kernel reaches; ``mem_ramp_s``
    the latency before it streams at that rate. ``launch_s``: device-side gap between back-to-back
    kernels. ``contention``: slowdown of compute while a collective runs on the same device
    (communication kernels occupy SMs / AI cores and HBM bandwidth). ``collective_base_s``: fixed
    software cost of one collective call (kernel launch, proxy handshake).
    """

    gemm_max: float
    gemm_k_half: float
    gemm_mn_half: float
    gemm_fill_s: float
    attn_fwd_max: float
    attn_bwd_max: float
    mem_max: float
    mem_ramp_s: float
    launch_s: float
    contention: float
    collective_base_s: float


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator: dense peak FLOP/s per dtype, HBM capacity (bytes) and bandwidth (bytes/s),
    and ``host_bw``: bytes/s one way between device and pinned host memory, as copies reach it (the
    tier ``mem.offload`` writes to)."""

    name: str
    vendor: str
    peak: tuple[tuple[str, float], ...]
    hbm_bytes: float
    hbm_bw: float
    eff: Efficiency
    host_bw: float

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; raises ValueError naming the dtypes this device has."""
        for name, flops in self.peak:
            if name == dtype:
                return flops
        have = ", ".join(n for n, _ in self.peak)
        raise ValueError(f"device {self.name} has no {dtype!r} peak; it supports {have}")

    @property
    def dtypes(self) -> tuple[str, ...]:
        """Dtypes with a published peak on this device."""
        return tuple(n for n, _ in self.peak)


@dataclass(frozen=True, slots=True)
class Link:
    """A link class: per-direction bandwidth per port (bytes/s), per-hop latency (s), and the
    fraction of line rate that collective libraries reach on it (``efficiency``)."""

    name: str
    bw: float
    latency_s: float
    efficiency: float

    @property
    def effective_bw(self) -> float:
        """Bytes/s per direction that collectives reach on this link."""
        return self.bw * self.efficiency


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """``nodes`` consecutive nodes whose ``nics_per_node`` ports of ``inter`` reach the scale-out
    fabric (a part of a cluster built from node groups with different NICs)."""

    nodes: int
    inter: Link
    nics_per_node: int

    def bw_per_device(self, devices_per_node: int) -> float:
        """Achievable inter-node bytes/s per device when every device of a node talks at once."""
        return self.nics_per_node * self.inter.effective_bw / devices_per_node


@dataclass(frozen=True, slots=True)
class Cluster:
    """``nodes`` nodes of ``devices_per_node`` devices: ``intra`` links inside a node (the per-device
    bandwidth into the node's fabric), ``nics_per_node`` ports of ``inter`` between nodes.

    ``groups`` (empty for one kind of NIC) splits the nodes, in rank order, into node groups with
    their own NICs; ``inter`` and ``nics_per_node`` are then the slowest group's, so whatever prices
    the cluster as a whole prices its slowest NIC. ``view`` gives the cluster as seen by
    collectives that stay inside some of the groups."""

    device: Device
    devices_per_node: int
    nodes: int
    intra: Link
    inter: Link
    nics_per_node: int
    groups: tuple[NodeGroup, ...] = ()

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1:
            raise ValueError(
                f"cluster needs >= 1 device per node and >= 1 node, got {self.devices_per_node}x{self.nodes}"
            )
        if self.nics_per_node < 1:
            raise ValueError(f"cluster needs >= 1 NIC per node, got {self.nics_per_node}")
        if self.groups and sum(g.nodes for g in self.groups) != self.nodes:
            raise ValueError(
                f"node groups hold {sum(g.nodes for g in self.groups)} nodes but the cluster has {self.nodes}"
            )

    @property
    def world_size(self) -> int:
        """Devices in the cluster."""
        return self.devices_per_node * self.nodes

    @property
    def inter_bw_per_device(self) -> float:
        """Achievable inter-node bytes/s per device when every device of a node talks at once."""
        return self.nics_per_node * self.inter.effective_bw / self.devices_per_node

    @property
    def heterogeneous(self) -> bool:
        """True when node groups have different NICs."""
        return len(self.groups) > 1

    def group_of_node(self, node: int) -> int:
        """Index of the node group that holds ``node`` (0 for a cluster of one kind of NIC)."""
        end = 0
        for i, g in enumerate(self.groups):
            end += g.nodes
            if node < end:
                return i
        return 0

    def view(self, groups: frozenset[int]) -> Cluster:
        """This cluster as a collective over nodes of the node ``groups`` sees it: one kind of NIC,
        the slowest of those groups' (a ring or tree is as fast as its slowest link)."""
        if not self.heterogeneous:
            return self
        slow = min((self.groups[i] for i in sorted(groups)), key=lambda g: g.bw_per_device(self.devices_per_node))
        return Cluster(self.device, self.devices_per_node, self.nodes, self.intra, slow.inter, slow.nics_per_node)

    def __str__(self) -> str:
        if not self.groups:
            usual = DEFAULT_FABRIC.get(self.device.name, ("", self.inter.name, 0))[1]
            nic = f"@{self.inter.name}" if self.inter.name != usual else ""
            return f"{self.device.name}:{self.devices_per_node}x{self.nodes}{nic}"
        return "+".join(f"{self.device.name}:{self.devices_per_node}x{g.nodes}@{g.inter.name}" for g in self.groups)


# --- links -------------------------------------------------------------------------------------
# NOTE: ``efficiency`` is the bus-bandwidth fraction nccl-tests / hccl_test report for large
# messages on that link class; latency is the per-step cost the NCCL tuning model uses.
LINKS: dict[str, Link] = {
    # NVLink 4 (H100/H200 SXM): 18 links, 900 GB/s bidirectional total = 450 GB/s per direction
    # (NVIDIA H100 datasheet); nccl-tests all-reduce busbw on 8x H100 ~ 360-370 GB/s (DGX H100
    # user guide / NVIDIA NCCL blog) -> 0.8; ~2 us NVLink hop incl. NCCL step (NCCL tuning tables).
    "nvlink4": Link("nvlink4", 450 * GB, 2.0e-6, 0.80),
    # NVLink 3 (A100 SXM): 12 links, 600 GB/s bidirectional = 300 GB/s per direction (NVIDIA A100
    # datasheet); 8x A100 all-reduce busbw ~ 230-240 GB/s (nccl-tests, DGX A100) -> 0.8.
    "nvlink3": Link("nvlink3", 300 * GB, 2.0e-6, 0.80),
    # HCCS (Ascend 910B, Atlas 800T A2): 8-NPU full mesh, 7 links x 56 GB/s = 392 GB/s per NPU
    # bidirectional (Huawei Atlas 800T A2 technical white paper) -> 196 GB/s per direction.
    "hccs": Link("hccs", 196 * GB, 3.0e-6, 0.75),
    # Unified Bus (Ascend 910C in CloudMatrix384): 392 GB/s unidirectional per NPU through the
    # non-blocking UB switch fabric (Zuo et al. 2025, "Serving Large Language Models on Huawei
    # CloudMatrix384", arXiv 2506.12708, sec. 3).
    "ub": Link("ub", 392 * GB, 3.0e-6, 0.75),
    # InfiniBand NDR 400 Gb/s per port = 50 GB/s per direction (NVIDIA ConnectX-7 datasheet);
    # ~ 0.9 of line rate in nccl-tests across nodes; ~ 5 us end-to-end RDMA latency incl. switch.
    "ib-ndr400": Link("ib-ndr400", 50 * GB, 5.0e-6, 0.90),
    # InfiniBand HDR 200 Gb/s = 25 GB/s per direction (NVIDIA ConnectX-6 datasheet, DGX A100).
    "ib-hdr200": Link("ib-hdr200", 25 * GB, 5.0e-6, 0.90),
    # RoCE v2 400 GbE = 50 GB/s per direction (IEEE 802.3bs 400GBASE); RoCE reaches a little less
    # of line rate than IB under congestion control (Meta, "RDMA over Ethernet for distributed AI
    # training at Meta scale", SIGCOMM 2024) -> 0.85, ~ 8 us latency through a Clos fabric.
    "roce400": Link("roce400", 50 * GB, 8.0e-6, 0.85),
    # RoCE v2 200 GbE = 25 GB/s per direction (Atlas 800T A2: 8 x 200GE ports, Huawei datasheet).
    "roce200": Link("roce200", 25 * GB, 8.0e-6, 0.85),
    # gloo between processes on one host (loopback TCP): measured on the 2-core CI machine, one
    # collective among 4 local ranks costs ~ 0.9 ms however small (all of it in the device's
    # ``collective_base_s``, none per ring step) and streams ~ 1 GB/s.
    "gloo": Link("gloo", 1.0e9, 0.0, 1.0),
}

# --- devices -----------------------------------------------------------------------------------
# Efficiency constants for Hopper (H100 / H200 share SMs and clocks):
# - gemm_max 0.60 and gemm_mn_half 2.58e6 are FITTED (``meshfold.sim.calibration.fit``, scipy least
#   squares on relative MFU error) on the fit half of the published runs only: Megatron-Core's
#   1.7B, 70B, 177B and 462B weak-scaling rows (the 16B row and the GPT-3 175B strong-scaling ends
#   are held out). Both are inside their physical ranges: gemm_max is 0.75 of H100 SXM bf16's
#   best-shape "maximum achievable matmul FLOPS" (~ 794 TFLOP/s = 0.80 of dense peak; S. Bekman,
#   "Machine Learning Engineering", MAMF table), what a 700 W part sustains over a step of mixed
#   shapes; gemm_mn_half is 1.2 x half a wave of 132 SMs x 128x256 tiles (2.16e6). Scored as plain
#   1F1B (not interleaved, ``calibration``) the runs had put the fit at the top of gemm_max's range.
# - gemm_k_half 96: a 128x256 Hopper tile drains its 32K-element fp32 accumulator in the epilogue,
#   about the cost of 64-128 K-steps of its main loop (CUTLASS 3 warp-specialised kernel design).
# - gemm_fill_s 6 us: prologue (first TMA loads) and epilogue of a kernel, paid once.
# - attention 0.50 / 0.38: cuDNN 9 / FlashAttention-3 fused attention on H100, head dim 128,
#   causal, seq 4k: ~ 500 TFLOP/s forward, ~ 380 backward on executed FLOPs (Shah et al. 2024,
#   "FlashAttention-3", figs. 5-7, cuDNN curves; FA3 itself is ~ 10-20 % faster).
# - mem_max 0.85, 2 us ramp: copy/elementwise kernels reach ~ 2.8-2.9 TB/s of 3.35 TB/s.
# - launch 3 us: device-side gap between dependent kernels in Nsight traces of eager PyTorch.
# - contention 0.12: while NCCL or userbuffer kernels run they hold 16-24 of the 132 SMs (one CTA
#   per channel, NCCL_MIN/MAX_NCHANNELS defaults on NVLink + IB) -> GEMMs beside them lose ~ 12 %.
# - collective_base 10 us: NCCL kernel launch + proxy handshake per collective (NCCL tuning
#   model base latency, src/graph/tuning.cc).
HOPPER = Efficiency(0.60, 96.0, 2.58e6, 6e-6, 0.50, 0.38, 0.85, 2e-6, 3e-6, 0.12, 10e-6)
# A100: MAMF 271 of 312 TFLOP/s = 0.87 (Bekman table) at boost clock, ~ 0.9 of that sustained
# -> 0.78; 108 SMs -> half wave 1.77e6; FlashAttention-2 peaks at ~ 0.70 forward / ~ 0.60
# backward of peak on A100 at long sequences (Dao 2023, "FlashAttention-2", figs. 4-6), typical
# training shapes somewhat lower -> 0.62 / 0.48.
AMPERE = Efficiency(0.78, 64.0, 1.77e6, 5e-6, 0.62, 0.48, 0.85, 2e-6, 3e-6, 0.12, 10e-6)
# Ascend 910B/910C (estimates): MindSpeed reports ~ 50 % MFU for dense LLM pre-training on 910B
# (Huawei MindSpeed-LLM README performance tables), consistent with ~ 0.68 of fp16 peak on
# large matmuls; 24-30 AI cores with 16x16x16 cubes -> smaller half wave; fused attention runs
# its softmax on the vector unit (slower than Hopper); CANN task dispatch costs more per kernel.
DAVINCI = Efficiency(0.68, 128.0, 0.8e6, 10e-6, 0.45, 0.35, 0.80, 3e-6, 5e-6, 0.12, 20e-6)
# One CPU thread per gloo rank (the test and CI machine): a plain max(flops / peak, bytes / bw)
# roofline with no ramps, fills or launch gaps (the measured figures below already are sustained
# rates); ~ 0.9 ms of fixed software cost per gloo collective (measured, 4 local ranks).
HOST = Efficiency(1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 9e-4)

# Pinned host <-> device copies over PCIe Gen5 x16 (64 GB/s a direction on the datasheets): 54.5 GB/s
# each way measured on an H100 SXM5 (1 GiB copies, median of 10, CUDA events); H200 has the same
# link. A100 (Gen4 x16) at half that. Ascend 910B/910C: no published figure; Gen4-class rate assumed.
PCIE5 = 54.5 * GB

DEVICES: dict[str, Device] = {
    # NVIDIA H100 SXM5 datasheet: FP32 67 TF, TF32 989 TF (sparse) = 494.7 dense, BF16/FP16 1979
    # (sparse) = 989.4 dense, FP8 3958 (sparse) = 1979 dense; 80 GB HBM3 at 3.35 TB/s.
    "h100": Device(
        "h100",
        "nvidia",
        (("fp32", 66.9 * TB), ("tf32", 494.7 * TB), ("bf16", 989.4 * TB), ("fp16", 989.4 * TB), ("fp8", 1978.9 * TB)),
        80 * GB,
        3.35 * TB,
        HOPPER,
        PCIE5,
    ),
    # NVIDIA H200 SXM datasheet: same Hopper compute as H100 SXM; 141 GB HBM3e at 4.8 TB/s.
    "h200": Device(
        "h200",
        "nvidia",
        (("fp32", 66.9 * TB), ("tf32", 494.7 * TB), ("bf16", 989.4 * TB), ("fp16", 989.4 * TB), ("fp8", 1978.9 * TB)),
        141 * GB,
        4.8 * TB,
        HOPPER,
        PCIE5,
    ),
    # NVIDIA A100 SXM4 80GB datasheet: FP32 19.5 TF, TF32 156 TF, BF16/FP16 312 TF (dense), no FP8;
    # 80 GB HBM2e at 2,039 GB/s.
    "a100": Device(
        "a100",
        "nvidia",
        (("fp32", 19.5 * TB), ("tf32", 156 * TB), ("bf16", 312 * TB), ("fp16", 312 * TB)),
        80 * GB,
        2.039 * TB,
        AMPERE,
        PCIE5 / 2,
    ),
    # Huawei Ascend 910B (910B3, Atlas 800T A2 datasheet): FP16/BF16 313 TFLOPS; 64 GB HBM2e at
    # 1.6 TB/s. FP32 / FP8 peaks are not published for the cube unit, so none are listed.
    "ascend910b": Device(
        "ascend910b", "huawei", (("bf16", 313 * TB), ("fp16", 313 * TB)), 64 * GB, 1.6 * TB, DAVINCI, PCIE5 / 2
    ),
    # Huawei Ascend 910C (dual-die package): BF16/FP16 752 TFLOPS, 128 GB HBM at 3.2 TB/s (Zuo et
    # al. 2025, arXiv 2506.12708, sec. 3.2).
    "ascend910c": Device(
        "ascend910c", "huawei", (("bf16", 752 * TB), ("fp16", 752 * TB)), 128 * GB, 3.2 * TB, DAVINCI, PCIE5 / 2
    ),
    # One thread of the CI machine's CPU, measured: ~ 10 GFLOP/s of fp32 matmul, streams ~ 4 GB/s;
    # no memory bound of its own (the host's RAM is not planned for). Host tier: the file-backed
    # copy, measured with backends/host_tier.py on 1-16 MiB tensors: offload 1.4-1.8 GB/s (fresh
    # pages faulted in), reload 3-4.5 GB/s, i.e. 2.2 GB/s each way on average over the round trip.
    LOCAL: Device(LOCAL, "host", (("fp32", 1.0e10),), math.inf, 4.0e9, HOST, 2.2e9),
}

# Default node fabric per device: (intra link, inter link, NICs per node at 8 devices per node).
# DGX H100/H200: 8 x ConnectX-7 NDR 400 (NVIDIA DGX H100 user guide); DGX A100: 8 x HDR 200
# (DGX A100 user guide); Atlas 800T A2: 8 x 200GE RoCE (Huawei); CloudMatrix384: 400 Gb/s of
# RDMA per NPU for scale-out (arXiv 2506.12708); a "node" of 910C may be set to the 384-NPU
# UB domain, e.g. ascend910c:384x4.
DEFAULT_FABRIC: dict[str, tuple[str, str, int]] = {
    "h100": ("nvlink4", "ib-ndr400", 8),
    "h200": ("nvlink4", "ib-ndr400", 8),
    "a100": ("nvlink3", "ib-hdr200", 8),
    "ascend910b": ("hccs", "roce200", 8),
    "ascend910c": ("ub", "roce400", 8),
    LOCAL: ("gloo", "gloo", 8),
}


def device(name: str) -> Device:
    """The catalog device called ``name`` (case-insensitive); ValueError lists the known names."""
    key = name.strip().lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(sorted(DEVICES))}")
    return DEVICES[key]


def link(name: str) -> Link:
    """The catalog link called ``name``; ValueError lists the known names."""
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}; known links: {', '.join(sorted(LINKS))}")
    return LINKS[name]


def make_cluster(
    device_name: str,
    devices_per_node: int,
    nodes: int,
    *,
    intra: str | None = None,
    inter: str | None = None,
    nics_per_node: int | None = None,
) -> Cluster:
    """A cluster of catalog parts; links and NIC count default to the device's usual node design
    (NICs scale with ``devices_per_node``: one per device on 8-device nodes)."""
    dev = device(device_name)
    d_intra, d_inter, d_nics = DEFAULT_FABRIC[dev.name]
    nics = nics_per_node if nics_per_node is not None else max(1, d_nics * devices_per_node // 8)
    return Cluster(dev, devices_per_node, nodes, link(intra or d_intra), link(inter or d_inter), nics)


def local_cluster(ranks: int) -> Cluster:
    """Gloo ranks on this CPU: one node of ``ranks`` processes of the ``cpu`` device, talking over
    loopback. The cluster a compile without one is planned for (``PassContext.cluster`` None)."""
    return make_cluster(LOCAL, max(1, ranks), 1)


def device_cluster(device_name: str, devices_per_node: int, ranks: int) -> Cluster | None:
    """``ranks`` devices that their driver names ``device_name`` (``torch.cuda.get_device_name``, e.g.
    ``"NVIDIA H100 80GB HBM3"``), ``devices_per_node`` to a node, with the part's default fabric;
    None when no catalog part is named in it."""
    words = device_name.lower().replace("-", " ").replace("_", " ").split()
    key = next((k for k in DEVICES if k != LOCAL and k in words), None)
    if key is None or ranks < 1:
        return None
    per_node = max(1, min(devices_per_node, ranks))
    return make_cluster(key, per_node, -(-ranks // per_node))


def parse_cluster(text: str) -> Cluster:
    """Parse ``DEVICE:GPUS_PER_NODExNODES`` (e.g. ``"h100:8x64"``) into a Cluster with the device's
    default fabric; ``@NIC`` after a part names its inter-node link (a ``LINKS`` name or ``ib`` =
    ib-ndr400, ``roce`` = roce200), and parts joined by ``+`` are node groups of one cluster with
    different NICs, e.g. ``"h100:8x4@ib+h100:8x4@roce"`` (same device and GPUs per node in every
    group). Ranks fill the groups fastest NIC first, so pipeline stage 0 -- whose gradient
    reduction has no later stage to hide behind -- sits on the fastest NICs. Raises ValueError
    naming the bad part and the accepted device and NIC names."""
    parts = [parse_part(text, part) for part in text.split("+")]
    name, per_node, _, nic = parts[0]
    if len(parts) == 1:
        return make_cluster(name, per_node, parts[0][2], inter=nic)
    for other in parts[1:]:
        if (other[0], other[1]) != (name, per_node):
            raise ValueError(
                f"cluster {text!r}: node groups must share the device and GPUs per node, got {name}:{per_node}x.. "
                f"and {other[0]}:{other[1]}x..; a cluster of mixed devices is not modelled"
            )
    base = make_cluster(name, per_node, 1)
    groups = [NodeGroup(n, link(k) if k else base.inter, base.nics_per_node) for _, _, n, k in parts]
    groups.sort(key=lambda g: -g.bw_per_device(per_node))  # NOTE: stable: equal NICs keep their order
    slow = groups[-1]
    nodes = sum(g.nodes for g in groups)
    return Cluster(base.device, per_node, nodes, base.intra, slow.inter, slow.nics_per_node, tuple(groups))


# NOTE: the text of a cluster: ``DEVICE:GPUS_PER_NODExNODES[@NIC]`` parts joined by ``+``
_CLUSTER_RE = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*:\s*(\S+?)\s*[xX]\s*([^@\s]+?)\s*(?:@\s*(\S+?))?\s*$")

NIC_ALIASES: dict[str, str] = {"ib": "ib-ndr400", "roce": "roce200"}
"""Short NIC names accepted after ``@``: InfiniBand NDR 400 Gb/s and RoCE v2 200 GbE per device port
(``LINKS`` gives their sources)."""


def parse_part(text: str, part: str) -> tuple[str, int, int, str | None]:
    """(device, GPUs per node, nodes, NIC link name or None) of one ``DEVICE:GxN[@NIC]`` part."""
    m = _CLUSTER_RE.match(part)
    known = ", ".join(sorted(DEVICES))
    if m is None:
        raise ValueError(
            f"cluster {text!r} must look like DEVICE:GPUS_PER_NODExNODES[@NIC][+...], e.g. h100:8x64 or "
            f"h100:8x4@ib+h100:8x4@roce (devices: {known})"
        )
    name, per_node, nodes, nic = m.groups()
    if name.lower() not in DEVICES:
        raise ValueError(f"cluster {text!r}: unknown device {name!r}; accepted devices: {known}")
    for label, value in (("GPUS_PER_NODE", per_node), ("NODES", nodes)):
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"cluster {text!r}: {label} {value!r} must be a positive integer, e.g. h100:8x64")
    key = None
    if nic is not None:
        key = NIC_ALIASES.get(nic.lower(), nic.lower())
        if key not in LINKS:
            names = ", ".join([*sorted(NIC_ALIASES), *sorted(LINKS)])
            raise ValueError(f"cluster {text!r}: unknown NIC {nic!r} after @; accepted: {names}")
    return name.lower(), int(per_node), int(nodes), key
