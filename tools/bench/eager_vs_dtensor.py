"""meshfold vs. the torchtitan way (DTensor eager TP + FSDP2): step time and bytes per step, one run.

    python -m meshfold.tools.bench.eager_vs_dtensor                      # 4 gloo CPU ranks, mesh (dp=2, tp=2)
    python -m meshfold.tools.bench.eager_vs_dtensor --layers 2 --steps 5 --profile

Spawns ``--world`` local CPU ranks (gloo, one thread each) and trains the same Llama-style model
(GQA + RoPE + SwiGLU, untied LM head; same weights, inputs and global batch) two ways:

1. meshfold: ``parallelize(model, mesh, inputs, plan="fsdp+tp")`` and AdamW on its DTensor params;
2. DTensor eager, the torchtitan way: ``parallelize_module`` with ``ColwiseParallel`` on q/k/v and
   gate/up and ``RowwiseParallel`` on o/down of every layer over ``tp``, then ``fully_shard`` (FSDP2)
   over ``dp`` on every layer and the root; each rank feeds its ``dp`` slice of the batch. The LM
   head stays whole on every tp rank unless ``--dtensor-lm-head loss-parallel`` (vocab-sharded,
   ``loss_parallel``; meshfold's ``tp`` preset shards the LM head on its own).

Both sides run the one model class below, whose attention infers the head count from the tensor
(``view(b, t, -1, head_dim)``), so the local q/k/v that ``ColwiseParallel`` hands back (a ``1/tp``
slice of the heads) need no DTensor inside the attention math.

Measured in one run: the median step time (forward + backward + AdamW between barriers, the two
sides' steps interleaved) after warm-up steps; collectives and bytes each rank sends per step (ring
volumes: all-gather ``(n-1)·in``, all-reduce ``2(n-1)/n·in``, reduce-scatter ``(n-1)/n·in``), for
meshfold from ``comm_summary`` and, for both sides, counted from the collectives actually dispatched
in the first warm-up step; the loss of every step, checked against each other and against a
single-device run. ``--profile`` adds torch.profiler tables of rank 0. Timings are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from meshfold.tools.ranks import free_port
from meshfold.tools.zoo.models import LlamaAttention, LlamaMLP, RMSNorm, Rotary, _apply_rope
from meshfold.tools.zoo.shared import _shifted_ce, _small_init

LOSS_TOL = 1e-4
WIRE_OPS = ("comm.all_gather", "comm.all_reduce", "comm.reduce_scatter", "comm.all_to_all")
SIZES = (
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "intermediate",
    "vocab",
    "seq",
    "batch",
)  # batch: global, dp divides it


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and run sizes (the same on both sides)."""

    vocab: int = 2048
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    seq: int = 128
    batch: int = 4
    lr: float = 1e-3
    warmup: int = 3
    steps: int = 10
    optimizer: str = "fused"
    """AdamW's implementation on every side (``OPTIMIZERS``); torchtitan's recipe defaults to the fused one."""


OPTIMIZERS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
"""AdamW's implementations, as torchtitan's ``implementation`` option names them."""


def adamw(params: Iterator[nn.Parameter], cfg: Config) -> torch.optim.Optimizer:
    """AdamW over ``params`` with ``cfg``'s learning rate and implementation (the same on every side)."""
    return torch.optim.AdamW(params, lr=cfg.lr, **OPTIMIZERS[cfg.optimizer])


class HeadInferringAttention(LlamaAttention):
    """``LlamaAttention`` whose views infer the head count, so it runs on a tp-local slice of heads."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        # NOTE: _repeat_kv repeats n_heads // n_kv_heads times; the ratio is the same on a tp slice.
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class BenchLayer(nn.Module):
    """Pre-RMSNorm Llama decoder layer (zoo FQNs: input_layernorm, self_attn.*, mlp.*)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        head_dim = cfg.hidden // cfg.heads
        self.input_layernorm = RMSNorm(cfg.hidden)
        self.self_attn = HeadInferringAttention(cfg.hidden, cfg.heads, cfg.kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(cfg.hidden)
        self.mlp = LlamaMLP(cfg.hidden, cfg.intermediate)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class BenchLlama(nn.Module):
    """Llama-style causal LM returning the shifted cross-entropy loss (sizes from ``Config``)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.rotary = Rotary(cfg.hidden // cfg.heads, max_seq=cfg.seq)
        self.layers = nn.ModuleList(BenchLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.apply(_small_init)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(input_ids.size(1))
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return _shifted_ce(self.lm_head(self.norm(x)), labels)


def build(cfg: Config) -> tuple[BenchLlama, tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic model (seed 0) and global ``(input_ids, labels)`` of shape [batch, seq]."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BenchLlama(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    return model, (ids, ids.clone())


_COLLECTIVES = {
    # op overload packet → (kind, index of the input tensor(s) in args)
    torch.ops._c10d_functional.all_gather_into_tensor: ("all_gather", 0),
    torch.ops._c10d_functional.all_reduce: ("all_reduce", 0),
    torch.ops._c10d_functional.reduce_scatter_tensor: ("reduce_scatter", 0),
    torch.ops._c10d_functional.all_to_all_single: ("all_to_all", 0),
    torch.ops._c10d_functional.all_gather_into_tensor_coalesced: ("all_gather", 0),
    torch.ops._c10d_functional.reduce_scatter_tensor_coalesced: ("reduce_scatter", 0),
    torch.ops._c10d_functional.all_reduce_coalesced: ("all_reduce", 0),
    # NOTE: the in-place and out= forms Inductor's generated code calls
    torch.ops._c10d_functional.all_reduce_: ("all_reduce", 0),
    torch.ops._c10d_functional.all_reduce_coalesced_: ("all_reduce", 0),
    torch.ops._c10d_functional.all_gather_into_tensor_out: ("all_gather", 0),
    torch.ops._c10d_functional.reduce_scatter_tensor_out: ("reduce_scatter", 0),
    torch.ops.c10d._allgather_base_: ("all_gather", 1),
    torch.ops.c10d.allgather_into_tensor_coalesced_: ("all_gather", 1),
    torch.ops.c10d.allgather_: ("all_gather", 1),
    torch.ops.c10d._reduce_scatter_base_: ("reduce_scatter", 1),
    torch.ops.c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", 1),
    torch.ops.c10d.allreduce_: ("all_reduce", 0),
    torch.ops.c10d.allreduce_coalesced_: ("all_reduce", 0),
    torch.ops.c10d.alltoall_base_: ("all_to_all", 1),
}


def _group_size(args: tuple[Any, ...]) -> int:
    """Ranks in the collective's group: a ProcessGroup argument, or a group name (functional ops)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return int(dist.ProcessGroup.unbox(a).size())
            except RuntimeError:
                continue  # NOTE: a ReduceOp or Work object, not the group
    name = next(a for a in reversed(args) if isinstance(a, str))
    return int(_resolve_process_group(name).size())


def _ring_bytes(kind: str, in_bytes: float, n: int) -> float:
    """Bytes one rank sends (ring algorithms; the same model as the IR's comm op wire volumes, ``OpDef.wire_bytes``)."""
    if kind == "all_gather":
        return in_bytes * (n - 1)
    if kind == "all_reduce":
        return 2 * in_bytes * (n - 1) / n
    return in_bytes * (n - 1) / n


class CommCounter(TorchDispatchMode):
    """Counts collectives dispatched on this rank (after DTensor desugars its ops) and their bytes.

    ``CommDebugMode`` counts collectives but reports no sizes, so this mode reads the input tensors.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, float] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # NOTE: let DTensor run first; its collectives come back through here
        out = func(*args, **(kwargs or {}))
        entry = _COLLECTIVES.get(getattr(func, "_overloadpacket", None))  # type: ignore[arg-type]
        if entry is not None:
            kind, idx = entry
            flat = [t for t in torch.utils._pytree.tree_leaves(args[idx]) if isinstance(t, torch.Tensor)]
            in_bytes = float(sum(t.numel() * t.element_size() for t in flat))
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0.0) + _ring_bytes(kind, in_bytes, _group_size(args))
        return out


class Side:
    """One way of training: its step function, and what its steps measured."""

    def __init__(self, step: Callable[[], torch.Tensor]) -> None:
        self.step = step
        self.counter = CommCounter()
        self.times: list[float] = []
        self.cpu: list[float] = []
        """CPU seconds this rank's process (every thread: gloo's workers too) spent in each step."""
        self.losses: list[torch.Tensor] = []

    def run(self, count: bool) -> None:
        """One step between barriers (all ranks start together; the time is the slowest rank's)."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with self.counter if count else contextlib.nullcontext():
            loss = self.step()
        dist.barrier()
        self.times.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)
        self.losses.append(loss.detach())


def _train(sides: list[Side], total: int) -> None:
    """``total`` steps of every side, interleaved step by step so that drift in machine load hits all
    sides alike; each side's first step runs under its ``CommCounter``."""
    for i in range(total):
        for side in sides:
            side.run(count=i == 0)


def _profile(step: Callable[[], torch.Tensor], label: str) -> str:
    """torch.profiler table of 2 steps on this rank; a barrier before each keeps stragglers out of the waits."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("bench.barrier"):
                dist.barrier()
            with record_function("bench.step"):
                step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
    return f"--- {label}: top ops by self CPU time over 2 steps (rank 0) ---\n{table}"


def _dtensor_model(model: nn.Module, mesh: Any, lm_head: str, mp_policy: Any = None) -> nn.Module:
    """torchtitan-style TP (colwise q/k/v/gate/up, rowwise o/down) over ``tp``, then FSDP2 over ``dp``
    (with ``mp_policy``, a ``MixedPrecisionPolicy``, where one is given).

    ``lm_head="loss-parallel"`` also shards the LM head on the vocab (logits stay a ``Shard(-1)``
    DTensor for ``loss_parallel``), as torchtitan does; ``"replicate"`` leaves it whole on every tp rank.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layers = model.layers
    assert isinstance(layers, nn.ModuleList)
    for layer in layers:
        plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel()}
        plan |= {"mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        parallelize_module(layer, mesh["tp"], plan)  # type: ignore[arg-type]
    if lm_head == "loss-parallel":
        head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model, mesh["tp"], {"lm_head": head})
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"], **policy)
    fully_shard(model, mesh=mesh["dp"], **policy)
    return model


def optimizer_option(ap: argparse.ArgumentParser, d: Config) -> None:
    """``--optimizer``: AdamW's implementation on every side."""
    ap.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default=d.optimizer,
        help="AdamW's implementation on every side (default: fused, torchtitan's default)",
    )


def trainer(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], cfg: Config, ctx: Callable[[], Any] = contextlib.nullcontext
) -> tuple[Callable[[], torch.Tensor], torch.optim.Optimizer]:
    """One AdamW training step of ``model`` on ``inputs`` (the loss under ``ctx``; a DTensor loss as
    this rank's local value), and its optimizer."""
    from torch.distributed.tensor import DTensor

    opt = adamw(model.parameters(), cfg)

    def step() -> torch.Tensor:
        opt.zero_grad()
        with ctx():
            loss = model(*inputs)
            loss.backward()
        opt.step()
        return loss.to_local() if isinstance(loss, DTensor) else loss

    return step, opt


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[None]:
    """This process as gloo rank ``rank`` of ``world`` on localhost, one thread, warnings off; the
    process group is destroyed on the way out."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn_ranks(rank_main: Callable[..., None], world: int, cfg: Config, opts: dict[str, Any]) -> Any:
    """Run ``rank_main(rank, world, port, cfg_dict, opts, queue)`` on ``world`` spawned processes and
    return what rank 0 put on ``queue`` (keep it small: the ranks are joined before it is read)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    rank_args = (world, free_port(), dataclasses.asdict(cfg), opts, queue)
    mp.start_processes(rank_main, args=rank_args, nprocs=world, join=True, start_method="spawn")
    return queue.get()


def _rank_main(rank: int, world: int, port: int, cfg_dict: dict[str, Any], opts: dict[str, Any], queue: Any) -> None:
    with gloo_rank(rank, world, port):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel

        from meshfold.api import parallelize
        from meshfold.passes.sharding.report import comm_summary

        loss_ctx = loss_parallel if opts["lm_head"] == "loss-parallel" else contextlib.nullcontext

        cfg = Config(**cfg_dict)
        mesh = init_device_mesh("cpu", tuple(opts["mesh"]), mesh_dim_names=("dp", "tp"))
        model, inputs = build(cfg)
        ref_copy = copy.deepcopy(model)
        total = cfg.warmup + cfg.steps
        out: dict[str, Any] = {"lm_head": opts["lm_head"]}

        t0 = time.perf_counter()
        pm = parallelize(model, mesh, inputs, plan="fsdp+tp")
        out["mf_compile_s"] = time.perf_counter() - t0
        mf_step, _ = trainer(pm, inputs, cfg)

        summary = comm_summary(pm.graph())
        # NOTE: comm.shard / comm.partial are local (a chunk, a zeroing): no message, so not counted here.
        wire = [c for c in summary if c.op in WIRE_OPS]
        out["mf_static"] = (sum(c.count for c in wire), sum(c.bytes_per_rank for c in wire))
        out["mf_lines"] = [(c.op, c.axis, c.phase, c.count, c.bytes_per_rank) for c in summary]

        t0 = time.perf_counter()
        dt_model = _dtensor_model(ref_copy, mesh, opts["lm_head"])
        out["dt_setup_s"] = time.perf_counter() - t0
        dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
        local = tuple(x.chunk(dp, dim=0)[dp_rank].contiguous() for x in inputs)
        dt_step, _ = trainer(dt_model, local, cfg, loss_ctx)

        mf, dt = Side(mf_step), Side(dt_step)
        _train([mf, dt], total)
        mf_times, mf_losses, mf_counter = mf.times, mf.losses, mf.counter
        dt_times, dt_losses, dt_counter = dt.times, dt.losses, dt.counter
        # NOTE: each dp rank's loss is the mean over its equal share of tokens; their mean is the global loss.
        dt_global = torch.stack(dt_losses)
        dist.all_reduce(dt_global, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
        profiles = [_profile(mf_step, "meshfold"), _profile(dt_step, "DTensor eager")] if opts["profile"] else []
        if rank == 0:
            out |= {
                "mf_times": mf_times[cfg.warmup :],
                "dt_times": dt_times[cfg.warmup :],
                "mf_losses": [float(x) for x in mf_losses],
                "dt_losses": dt_global.tolist(),
                "mf_traced": (sum(mf_counter.counts.values()), sum(mf_counter.bytes.values())),
                "dt_traced": (sum(dt_counter.counts.values()), sum(dt_counter.bytes.values())),
                "mf_kinds": {k: (n, mf_counter.bytes[k]) for k, n in mf_counter.counts.items()},
                "dt_kinds": {k: (n, dt_counter.bytes[k]) for k, n in dt_counter.counts.items()},
                "profiles": profiles,
            }
            queue.put(out)


def _single_device(cfg: Config) -> list[float]:
    model, inputs = build(cfg)
    opt = adamw(model.parameters(), cfg)
    losses = []
    for _ in range(cfg.warmup + cfg.steps):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _report(cfg: Config, mesh: tuple[int, int], r: dict[str, Any], ref: list[float]) -> int:
    mib = 2**20
    mf_ms = statistics.median(r["mf_times"]) * 1e3
    dt_ms = statistics.median(r["dt_times"]) * 1e3
    n_params = sum(p.numel() for p in build(cfg)[0].parameters())
    print(
        f"model: Llama-style, {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads ({cfg.kv_heads} kv), "
        f"intermediate {cfg.intermediate}, vocab {cfg.vocab}, {n_params / 1e6:.2f} M params; "
        f"batch {cfg.batch} x seq {cfg.seq}"
    )
    print(
        f"mesh: dp={mesh[0]} x tp={mesh[1]} ({mesh[0] * mesh[1]} gloo CPU ranks, 1 thread each); "
        f"{cfg.warmup} warm-up + {cfg.steps} timed steps, AdamW ({cfg.optimizer}) lr {cfg.lr}"
    )
    print(
        f"setup: meshfold parallelize {r['mf_compile_s']:.1f} s; DTensor parallelize_module+fully_shard "
        f"{r['dt_setup_s']:.2f} s"
    )
    head = "vocab-sharded over tp + loss_parallel" if r["lm_head"] == "loss-parallel" else "replicated over tp"
    print(f"plans: meshfold 'fsdp+tp' (tp roles from dataflow); DTensor TP on q/k/v/o + gate/up/down, LM head {head}\n")
    rows = [
        ("median step (ms)", f"{mf_ms:.1f}", f"{dt_ms:.1f}"),
        (
            "min / max step (ms)",
            f"{min(r['mf_times']) * 1e3:.0f} / {max(r['mf_times']) * 1e3:.0f}",
            f"{min(r['dt_times']) * 1e3:.0f} / {max(r['dt_times']) * 1e3:.0f}",
        ),
        ("collectives / step (traced)", str(r["mf_traced"][0]), str(r["dt_traced"][0])),
        ("MiB / rank / step (traced)", f"{r['mf_traced'][1] / mib:.3f}", f"{r['dt_traced'][1] / mib:.3f}"),
        ("collectives / step (comm_summary)", str(r["mf_static"][0]), "-"),
        ("MiB / rank / step (comm_summary)", f"{r['mf_static'][1] / mib:.3f}", "-"),
        ("loss, first step", f"{r['mf_losses'][0]:.6f}", f"{r['dt_losses'][0]:.6f}"),
        (f"loss, step {len(ref)}", f"{r['mf_losses'][-1]:.6f}", f"{r['dt_losses'][-1]:.6f}"),
    ]
    w0 = max(len(a) for a, _, _ in rows)
    print(f"{'':<{w0}}  {'meshfold':>14}  {'DTensor eager':>14}")
    for a, b, c in rows:
        print(f"{a:<{w0}}  {b:>14}  {c:>14}")
    print(f"\nmeshfold speed-up (dtensor_time / meshfold_time): {dt_ms / mf_ms:.2f}x")
    print(f"bytes ratio (dtensor / meshfold, traced): {r['dt_traced'][1] / max(r['mf_traced'][1], 1.0):.2f}x")
    for side, key in (("meshfold", "mf_kinds"), ("DTensor eager", "dt_kinds")):
        kinds = ", ".join(f"{k} x{n} {b / mib:.3f} MiB" for k, (n, b) in r[key].items())
        print(f"traced per step, {side}: {kinds}")
    lines = (f"{op.removeprefix('comm.')} {ax} {ph} x{n} {b / mib:.3f} MiB" for op, ax, ph, n, b in r["mf_lines"])
    print("meshfold comm_summary: " + "; ".join(lines))

    pair = max(abs(a - b) for a, b in zip(r["mf_losses"], r["dt_losses"], strict=True))
    first_mf, first_dt = abs(r["mf_losses"][0] - ref[0]), abs(r["dt_losses"][0] - ref[0])
    last_mf, last_dt = abs(r["mf_losses"][-1] - ref[-1]), abs(r["dt_losses"][-1] - ref[-1])
    print(f"\nsingle device: first-step loss {ref[0]:.6f}, step-{len(ref)} loss {ref[-1]:.6f}")
    print(
        f"|meshfold - single| first {first_mf:.1e}, last {last_mf:.1e}; "
        f"|dtensor - single| first {first_dt:.1e}, last {last_dt:.1e}; "
        f"max |meshfold - dtensor| over all steps {pair:.1e}"
    )
    ok = max(pair, first_mf, first_dt) <= LOSS_TOL
    bad = "!!! LOSSES DISAGREE (tolerance 1e-4): the figures above compare different computations !!!"
    print("losses agree (tolerance 1e-4)" if ok else bad)
    for text in r["profiles"]:
        print("\n" + text)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Parse options, spawn the ranks, run the single-device reference, print the table."""
    d = Config()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="number of gloo ranks")
    ap.add_argument("--mesh", default="2,2", help="dp,tp sizes (product = world)")
    ap.add_argument("--steps", type=int, default=d.steps, help="timed steps")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first (the first counts bytes)")
    for size in SIZES:
        ap.add_argument(f"--{size.replace('_', '-')}", type=int, default=getattr(d, size))
    ap.add_argument(
        "--dtensor-lm-head",
        choices=("replicate", "loss-parallel"),
        default="replicate",
        help="DTensor side: LM head whole on every tp rank, or vocab-sharded with loss_parallel (torchtitan)",
    )
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler tables of rank 0")
    optimizer_option(ap, d)
    a = ap.parse_args(argv)
    mesh = tuple(int(s) for s in a.mesh.split(","))
    if len(mesh) != 2 or mesh[0] * mesh[1] != a.world:
        ap.error(f"--mesh {a.mesh} must be two sizes dp,tp whose product is --world {a.world}")
    if a.warmup < 1:
        ap.error("--warmup must be at least 1 (the first warm-up step counts collectives)")
    sizes = {size: getattr(a, size) for size in SIZES}
    cfg = dataclasses.replace(d, warmup=a.warmup, steps=a.steps, optimizer=a.optimizer, **sizes)
    opts = {"mesh": mesh, "profile": a.profile, "lm_head": a.dtensor_lm_head}
    result = spawn_ranks(_rank_main, a.world, cfg, opts)
    ref = _single_device(cfg)
    return _report(cfg, (mesh[0], mesh[1]), result, ref)


if __name__ == "__main__":
    sys.exit(main())
