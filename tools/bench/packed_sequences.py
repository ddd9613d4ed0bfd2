"""Variable-length sequences under context parallelism: a context-parallel degree per sequence, by
its length (``meshfold.packing``), against one fixed degree for all, on gloo ranks.

    python -m meshfold.tools.bench.packed_sequences                  # 4 ranks, rows of 4096 tokens
    python -m meshfold.tools.bench.packed_sequences --tokens 2048 --batches 2 --repeats 2

Each batch draws sequence lengths from a long-tailed (log-normal) distribution until a row of
``--tokens`` is nearly full, and packs them twice for ``--world`` cp ranks: with per-sequence
degrees (the default ``pack_sequences``: long sequences split over every rank, short ones whole
on one, balanced by attention work) and with one fixed degree (``split_above=0``: every sequence
split over every rank, as a plain cp plan has it). HF Llama (``hf-llama-packed``'s model at
``--hidden`` and ``--layers``) is compiled once under ``plan="cp"``, ``cp={"method": --method}``: the
packing is data, so both packings run the same program, alternately, step by step (a paired
A/B). Printed, never asserted:

* per packing: the median step time (forward + backward, after a warm-up step) over batches and
  repeats, its ratio to the fixed degree's, the load average;
* the elements the attention sent per step (every rank, forward and backward: keys, values and
  their gradients under ring attention; queries and what travels with them, and their results,
  under TokenRing), and its ratio to the fixed degree's;
* the packing's balance: the busiest rank's attention work over the mean;
* the loss of each against the plain model on one device (one thread, this process) given the
  same sequences in order: the same loss, whichever packing; and that model's median step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from meshfold.tools.bench.eager_vs_dtensor import Config, gloo_rank, spawn_ranks
from meshfold.tools.measure import one_thread

MODES = ("per-sequence", "fixed")


def batches(count: int, tokens: int, seed: int) -> list[list[torch.Tensor]]:
    """``count`` batches of token sequences with log-normal lengths (median about 150 tokens, a tail
    into the thousands) filling up to 97% of ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        seqs: list[torch.Tensor] = []
        used = 0
        while True:
            n = int(torch.empty(1).log_normal_(5.0, 1.1, generator=g).clamp(8, tokens // 2))
            if used + n > 0.97 * tokens:
                break
            seqs.append(torch.randint(1, 2048, (n,), generator=g))
            used += n
        out.append(seqs)
    return out


def _model(cfg: Config) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshfold.tools.zoo.hf_zoo import _packed_cls
    from meshfold.tools.zoo.shared import _seeded

    config = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        intermediate_size=cfg.intermediate,
        max_position_embeddings=cfg.seq,
        attn_implementation="sdpa",
    )
    return _seeded(lambda: _packed_cls(LlamaForCausalLM)(config))


def _packings(cfg: Config, opts: dict[str, Any], ranks: int) -> list[dict[str, Any]]:
    from meshfold.packing import pack_sequences

    out = []
    for seqs in batches(opts["batches"], cfg.seq, opts["seed"]):
        row = {"per-sequence": pack_sequences(seqs, ranks=ranks, tokens=cfg.seq, balance=opts["balance"])}
        row["fixed"] = pack_sequences(seqs, ranks=ranks, tokens=cfg.seq, split_above=0)
        row["one device"] = pack_sequences(seqs, ranks=1, tokens=cfg.seq)
        out.append(row)
    return out


def _step(model: Any, inputs: tuple[torch.Tensor, ...]) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    return float(loss.detach().to_local() if hasattr(loss.detach(), "to_local") else loss.detach())


def _rank_main(rank: int, world: int, port: int, cfg_dict: dict[str, Any], opts: dict[str, Any], queue: Any) -> None:
    with gloo_rank(rank, world, port):
        from torch.distributed.device_mesh import init_device_mesh

        from meshfold.api import parallelize
        from meshfold.backends.context_parallel import p2p

        cfg = Config(**cfg_dict)
        rows = _packings(cfg, opts, world)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        pm = parallelize(_model(cfg), mesh, rows[0]["per-sequence"].inputs(), plan="cp", cp={"method": opts["method"]})
        sent = [0]
        start = p2p.start

        def counted(group: Any, send: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            # NOTE: what the attention sends, forward and backward (not the zigzag move)
            if sys._getframe(1).f_code.co_name in ("_around", "ring_backward", "_steps", "_home"):
                sent[0] += sum(t.numel() for t in send)
            return start(group, send, *args, **kwargs)

        p2p.start = counted  # type: ignore[assignment]
        got: dict[str, dict[str, list[float]]] = {m: {"times": [], "sent": [], "loss": []} for m in MODES}
        for row in rows:
            for mode in MODES:
                _step(pm, row[mode].inputs())  # NOTE: warm-up
            for _ in range(opts["repeats"]):
                for mode in MODES:
                    sent[0] = 0
                    dist.barrier()
                    t0 = time.perf_counter()
                    loss = _step(pm, row[mode].inputs())
                    dist.barrier()
                    got[mode]["times"].append(time.perf_counter() - t0)
                    total = torch.tensor([sent[0]], dtype=torch.float64)
                    dist.all_reduce(total)
                    got[mode]["sent"].append(float(total))
                    got[mode]["loss"].append(loss)
        if rank == 0:
            queue.put(got)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="gloo ranks (the cp size)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of one packed row")
    ap.add_argument("--batches", type=int, default=3, help="batches drawn")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps of each packing per batch")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--balance", type=float, default=0.2, help="pack_sequences' balance (per-sequence degrees)")
    ap.add_argument("--method", choices=("ring", "tokenring"), default="ring", help="the cp method")
    args = ap.parse_args(argv)
    cfg = Config(hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4, seq=args.tokens, batch=1)
    opts = {
        "batches": args.batches,
        "repeats": args.repeats,
        "seed": args.seed,
        "balance": args.balance,
        "method": args.method,
    }
    rows = _packings(cfg, opts, args.world)
    print(
        f"model: HF Llama, hidden {cfg.hidden}, {cfg.layers} layers, {cfg.heads} heads ({cfg.kv_heads} of keys/values)"
    )
    print(
        f"{args.batches} batches of {args.tokens} tokens on {args.world} gloo ranks (cp={args.world}, "
        f"{args.method}), one thread each"
    )
    for i, row in enumerate(rows):
        docs = row["one device"].doc_ids[0]
        lengths = sorted((int(x) for x in torch.bincount(docs[docs >= 0])), reverse=True)
        per = row["per-sequence"]
        print(
            f"  batch {i}: {len(lengths)} sequences, longest {lengths[:4]}, median {statistics.median(lengths):.0f}; "
            "per-sequence degrees (degree: sequences) "
            + ", ".join(f"{d}: {per.degrees.count(d)}" for d in sorted(set(per.degrees)))
        )
    model = _model(cfg)
    base, base_times = [], []
    with one_thread():
        for row in rows:
            base.append(_step(model, row["one device"].inputs()))
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                _step(model, row["one device"].inputs())
                base_times.append(time.perf_counter() - t0)
    got = spawn_ranks(_rank_main, args.world, cfg, opts)
    fixed_t, fixed_sent = statistics.median(got["fixed"]["times"]), statistics.median(got["fixed"]["sent"])
    head = f"{'median s':>9} {'ratio':>7} {'sent':>11} {'ratio':>7} {'work max/mean':>14} {'load':>5}"
    print(f"\n{'packing':<14} {head}  loss - one device")
    for mode in MODES:
        t, sent = statistics.median(got[mode]["times"]), statistics.median(got[mode]["sent"])
        work = [row[mode].attention_work() for row in rows]
        balance = max(max(w) / (sum(w) / len(w)) for w in work)
        diff = max(abs(a - b) for a, b in zip(got[mode]["loss"][:: args.repeats], base, strict=True))
        print(
            f"{mode:<14} {t:>9.3f} {t / fixed_t:>7.2f} {sent:>11.0f} {sent / fixed_sent:>7.2f} {balance:>14.3f} "
            f"{os.getloadavg()[0]:>5.2f}  {diff:.1e}"
        )
    t1 = statistics.median(base_times)
    print(
        f"{'one device':<14} {t1:>9.3f} {t1 / fixed_t:>7.2f} {'-':>11} {'-':>7} {'-':>14} {os.getloadavg()[0]:>5.2f}  -"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
