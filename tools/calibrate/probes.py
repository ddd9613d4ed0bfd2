"""What ``meshfold calibrate`` measures, on every rank at once (contention is part of the figure).

``measure`` runs inside an initialised process group (local gloo ranks, a ``RankPool`` task, or
``torchrun``) and returns the same plain record on every rank: for each probe point its shape or
size and its time in seconds -- the median over repeats of the slowest rank's time (a barrier
before each timed region; each region runs the probe enough times back to back to be long against
the clock's resolution). Probes:

* ``launch``: tiny eager ops (the fixed cost of one op: dispatch, allocation, kernel launch);
* ``stream``: large copies and adds (streaming memory bandwidth);
* ``gemm``: ``torch.mm`` by dtype on square and skinny shapes;
* ``attention``: causal ``scaled_dot_product_attention`` in fp32, forward and backward apart, by
  sequence length and head dim (the kernel a program's attention runs);
* ``collective``: all-reduce, all-gather, reduce-scatter, all-to-all (``_c10d_functional``, what
  compiled programs run) and send/recv over the world and over groups of 2, at several sizes;
* ``host``: ``mem.offload`` + ``mem.reload`` round trips (``backends.host_tier``, the tier the
  memory pass offloads to);
* ``solo``: the largest GEMM per dtype, the largest copy and the largest send with rank 0 alone
  busy (the device's own rates, which the fit sets beside the all-ranks ones).

Nothing here fits or interprets; ``fitting`` does.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshfold.backends import host_tier

MIB = 2**20


@dataclass(frozen=True)
class Grid:
    """The probe points of one calibration: shapes, sizes, repeats and the length of a timed region."""

    squares: tuple[int, ...]
    skinny: tuple[tuple[int, int, int], ...]
    stream_bytes: tuple[int, ...]
    comm_bytes: tuple[int, ...]
    host_bytes: tuple[int, ...]
    attention: tuple[tuple[int, int], ...]
    """(sequence, head dim) of the attention probes, 4 heads each."""
    repeats: int
    region_s: float


# NOTE: sizes span small (fixed costs dominate) to large (rates dominate) on a CPU rank; the largest
# fp32 square (1024) takes ~ 0.2-0.5 s per rank with 4 ranks on 2 cores.
FULL = Grid(
    squares=(32, 64, 128, 256, 512, 1024),
    skinny=((16, 1024, 1024), (1024, 1024, 16), (4096, 256, 64)),
    stream_bytes=(64 * 2**10, MIB, 4 * MIB, 16 * MIB, 64 * MIB),
    comm_bytes=(4 * 2**10, 64 * 2**10, MIB, 8 * MIB),
    host_bytes=(MIB, 4 * MIB, 16 * MIB),
    attention=((128, 16), (512, 16), (1024, 16), (256, 64), (1024, 64)),
    repeats=5,
    region_s=0.02,
)
QUICK = Grid(
    squares=(32, 128, 384),
    skinny=((16, 512, 512), (512, 512, 16)),
    stream_bytes=(256 * 2**10, 4 * MIB),
    comm_bytes=(4 * 2**10, 256 * 2**10, 2 * MIB),
    host_bytes=(MIB, 4 * MIB),
    attention=((128, 16), (256, 32)),
    repeats=3,
    region_s=0.003,
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
MAX_INNER = 2000
MAX_CALL_S = 0.25
"""Longest matmul call a calibration times (a larger shape of a slow dtype adds nothing the fit needs)."""


class _Clock:
    """Times a probe on every rank: barrier, ``inner`` calls back to back, device sync; the slowest
    rank's time per repeat, median over repeats."""

    def __init__(self, device: torch.device, grid: Grid) -> None:
        self.device = device
        self.grid = grid

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def slowest(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.cpu()]

    def time(self, fn: Callable[[], Any], *, active: bool = True) -> float:
        """Median over repeats of the slowest rank's seconds per call of ``fn`` (ranks with
        ``active`` False only take part in the barriers: a solo probe)."""
        for _ in range(2):  # NOTE: warm-up: first-call allocations, oneDNN primitive caches
            if active:
                fn()
        self.sync()
        dist.barrier()
        start = time.perf_counter()
        if active:
            fn()
        self.sync()
        (once,) = self.slowest([time.perf_counter() - start])
        inner = max(1, min(MAX_INNER, math.ceil(self.grid.region_s / max(once, 1e-7))))
        times = []
        for _ in range(self.grid.repeats):
            dist.barrier()
            start = time.perf_counter()
            if active:
                for _ in range(inner):
                    fn()
            self.sync()
            times.append((time.perf_counter() - start) / inner if active else 0.0)
        return statistics.median(self.slowest(times))


def dtypes_here(device: torch.device) -> list[str]:
    """The dtypes whose matmul runs on ``device`` (fp32 always; bf16 where a small one runs)."""
    out = ["fp32"]
    try:
        a = torch.ones(8, 8, dtype=torch.bfloat16, device=device)
        torch.mm(a, a)
        out.append("bf16")
    except RuntimeError:
        pass
    return out


def _launch(clock: _Clock, device: torch.device) -> list[dict[str, Any]]:
    x = torch.zeros(1, device=device)
    y = torch.zeros(64, device=device)
    z = torch.empty(64, device=device)
    probes: dict[str, tuple[Callable[[], Any], int]] = {
        "add_ 1": (lambda: x.add_(1.0), 2 * 4),
        "mul 64": (lambda: torch.mul(y, y, out=z), 3 * 64 * 4),
        "neg 64": (lambda: torch.neg(y), 2 * 64 * 4),
    }
    return [{"op": name, "bytes": nbytes, "seconds": clock.time(fn)} for name, (fn, nbytes) in probes.items()]


def _stream(clock: _Clock, device: torch.device, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    out = []
    for size in sizes:
        a = torch.rand(size // 4, device=device)
        b = torch.empty_like(a)
        c = torch.empty_like(a)
        # NOTE: bytes a kernel moves: a copy reads and writes; an add reads two and writes one
        copy = clock.time(lambda a=a, b=b: b.copy_(a))
        add = clock.time(lambda a=a, b=b, c=c: torch.add(a, b, out=c))
        out.append({"op": "copy", "size": size, "bytes": 2 * size, "seconds": copy})
        out.append({"op": "add", "size": size, "bytes": 3 * size, "seconds": add})
    return out


def _gemm_shapes(grid: Grid) -> list[tuple[int, int, int]]:
    return [(n, n, n) for n in grid.squares] + list(grid.skinny)


def _gemm(clock: _Clock, device: torch.device, dtypes: list[str], grid: Grid) -> list[dict[str, Any]]:
    """Each shape by FLOPs, smallest first; a shape the best rate so far says would take longer
    than ``MAX_CALL_S`` a call is left out (bf16 without native support runs ~50x slower than fp32;
    every rank sees the same slowest-rank times, so all leave out the same shapes)."""
    out = []
    for name in dtypes:
        best = 0.0
        for m, n, k in sorted(_gemm_shapes(grid), key=math.prod):
            if best and 2 * m * n * k / best > MAX_CALL_S:
                continue
            a = torch.rand(m, k, device=device).to(DTYPES[name])
            b = torch.rand(k, n, device=device).to(DTYPES[name])
            c = torch.empty(m, n, device=device, dtype=DTYPES[name])
            t = clock.time(lambda a=a, b=b, c=c: torch.mm(a, b, out=c))
            out.append({"dtype": name, "m": m, "n": n, "k": k, "seconds": t})
            best = max(best, 2 * m * n * k / t)
    return out


HEADS = 4
"""Heads of an attention probe."""


def _attention(clock: _Clock, device: torch.device, shapes: tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    """Causal attention of one sequence: the forward alone, and forward + backward, whose difference
    is the backward's time (a backward needs the forward's graph, so it is never timed alone)."""
    out = []
    for seq, dim in shapes:
        q, k, v = (torch.rand(1, HEADS, seq, dim, device=device, requires_grad=True) for _ in range(3))
        grad = torch.rand(1, HEADS, seq, dim, device=device)

        def fwd(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> Any:
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, g: torch.Tensor = grad) -> Any:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

        forward, whole = clock.time(fwd), clock.time(both)
        shape = {"seq": seq, "heads": HEADS, "dim": dim, "dtype": "fp32"}
        out.append(shape | {"pass": "fwd", "seconds": forward})
        out.append(shape | {"pass": "bwd", "seconds": max(whole - forward, 0.05 * whole)})
    return out


def _collective(kind: str, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> Callable[[], Any]:
    ops = torch.ops._c10d_functional
    name = group.group_name
    if kind == "all_reduce":
        return lambda: ops.wait_tensor(ops.all_reduce(x, "sum", name))
    if kind == "all_gather":
        return lambda: ops.wait_tensor(ops.all_gather_into_tensor(x, size, name))
    if kind == "reduce_scatter":
        return lambda: ops.wait_tensor(ops.reduce_scatter_tensor(x, "sum", size, name))
    split = [x.numel() // size] * size
    return lambda: ops.wait_tensor(ops.all_to_all_single(x, split, split, name))


def _input_elems(kind: str, nbytes: int, size: int) -> int:
    """fp32 elements of each rank's input so that ``nbytes`` is ``comm``'s logical buffer: the
    gathered output of an all-gather (each rank gives 1/size), the whole input otherwise."""
    elems = max(size, nbytes // 4 // size * size)
    return elems // size if kind == "all_gather" else elems


def _p2p(rank: int, world: int, x: torch.Tensor, pairs: int) -> tuple[Callable[[], Any], bool]:
    """Ranks 2i send to 2i+1 for the first ``pairs`` pairs (all at once); the others idle."""
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    active = rank // 2 < pairs and peer < world
    if rank % 2 == 0:
        return (lambda: dist.send(x, peer)), active
    return (lambda: dist.recv(x, peer)), active


def _collectives(
    clock: _Clock, device: torch.device, rank: int, world: int, local: int, sizes: tuple[int, ...]
) -> list[dict[str, Any]]:
    if world < 2:
        return []
    groups: list[tuple[dist.ProcessGroup, int, int, int]] = []
    world_group = dist.group.WORLD
    assert world_group is not None
    groups.append((world_group, world, min(local, world), max(1, world // max(1, local))))
    if world >= 4 and world % 2 == 0:
        pair, _ = dist.new_subgroups(2)
        groups.append((pair, 2, 2 if local % 2 == 0 else 1, 1 if local % 2 == 0 else 2))
    out = []
    for group, size, per_node, nodes in groups:
        for kind in KINDS[:4]:
            for nbytes in sizes:
                elems = _input_elems(kind, nbytes, size)
                x = torch.rand(elems, device=device)
                t = clock.time(_collective(kind, x, group, size))
                logical = elems * 4 * (size if kind == "all_gather" else 1)
                row = {"kind": kind, "size": size, "per_node": per_node, "nodes": nodes, "bytes": logical}
                out.append(row | {"seconds": t})
    for nbytes in sizes:
        x = torch.rand(nbytes // 4, device=device)
        fn, active = _p2p(rank, world, x, world // 2)
        cross = local % 2 == 1  # NOTE: a pair 2i, 2i+1 shares a node when nodes hold an even count
        row = {"kind": "p2p", "size": 2, "per_node": 1 if cross else 2, "nodes": 2 if cross else 1, "bytes": nbytes}
        out.append(row | {"seconds": clock.time(fn, active=active)})
    return out


def _host(clock: _Clock, device: torch.device, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    out = []
    for size in sizes:
        x = torch.rand(size // 4, device=device)
        t = clock.time(lambda x=x: host_tier.reload(host_tier.offload(x)))
        out.append({"op": "offload+reload", "size": size, "bytes": 2 * size, "seconds": t})
    return out


def _solo(
    clock: _Clock, device: torch.device, rank: int, world: int, gemm: list[dict[str, Any]], grid: Grid
) -> dict[str, Any]:
    """Rank 0 alone busy: the largest square GEMM measured per dtype, the largest copy, and (with two ranks
    or more) one send of the largest message from rank 0 to rank 1."""
    out: dict[str, Any] = {"gemm": []}
    for name in dict.fromkeys(p["dtype"] for p in gemm):
        n = max(p["m"] for p in gemm if p["dtype"] == name and p["m"] == p["n"] == p["k"])
        a = torch.rand(n, n, device=device).to(DTYPES[name])
        c = torch.empty_like(a)
        t = clock.time(lambda a=a, c=c: torch.mm(a, a, out=c), active=rank == 0)
        out["gemm"].append({"dtype": name, "m": n, "n": n, "k": n, "seconds": t})
    size = max(grid.stream_bytes)
    a = torch.rand(size // 4, device=device)
    b = torch.empty_like(a)
    t = clock.time(lambda: b.copy_(a), active=rank == 0)
    out["stream"] = {"op": "copy", "size": size, "bytes": 2 * size, "seconds": t}
    if world >= 2:
        nbytes = max(grid.comm_bytes)
        x = torch.rand(nbytes // 4, device=device)
        fn, active = _p2p(rank, world, x, 1)
        out["p2p"] = {"kind": "p2p", "bytes": nbytes, "seconds": clock.time(fn, active=active)}
    return out


def where(device: torch.device, quick: bool) -> dict[str, Any]:
    """Where, when and how a calibration runs: host, torch, world, backend, device."""
    world = dist.get_world_size()
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} thread(s) per rank)"
    )
    return {
        "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch": torch.__version__,
        "backend": str(dist.get_backend()),
        "world_size": world,
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        "device": name,
        "device_type": device.type,
        "cpus": os.cpu_count(),
        "grid": "quick" if quick else "full",
    } | ({"memory_bytes": torch.cuda.get_device_properties(device).total_memory} if device.type == "cuda" else {})


def measure(quick: bool = False, device: str = "cpu", stage: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every probe on every rank of the current process group; the same record on every rank:
    ``where`` plus the points by probe (see the module doc). ``stage`` is told each probe's name."""
    dev = torch.device(device)
    grid = QUICK if quick else FULL
    clock = _Clock(dev, grid)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dtypes = dtypes_here(dev)
    say = stage or (lambda text: None)
    start = time.perf_counter()
    points: dict[str, Any] = {}
    say("measuring the fixed cost of tiny ops")
    points["launch"] = _launch(clock, dev)
    say("measuring streaming memory bandwidth")
    points["stream"] = _stream(clock, dev, grid.stream_bytes)
    say(f"measuring matmuls ({', '.join(dtypes)})")
    points["gemm"] = _gemm(clock, dev, dtypes, grid)
    say("measuring attention")
    points["attention"] = _attention(clock, dev, grid.attention)
    say("measuring collectives")
    points["collective"] = _collectives(clock, dev, rank, world, local, grid.comm_bytes)
    say("measuring host offload and reload")
    points["host"] = _host(clock, dev, grid.host_bytes)
    say("measuring rank 0 alone")
    points["solo"] = _solo(clock, dev, rank, world, points["gemm"], grid)
    dist.barrier()
    return {"where": where(dev, quick) | {"seconds": time.perf_counter() - start}, "points": points}
