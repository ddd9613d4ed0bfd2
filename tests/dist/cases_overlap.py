"""Tasks that profile one training step of a compiled model and report, from ``torch.profiler``, when
each collective was issued and waited for and when the rank computed in between."""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from meshfold.api import parallelize
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo.models import LlamaTiny

ISSUE = (
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::all_to_all_single",  # NOTE: gloo's all-gathers and reduce-scatters (``comm.issue``)
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_reduce",
)
WAIT = "_c10d_functional::wait_tensor"
COMPUTE = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu")


def profiled_step(pipeline: str, hidden: int, batch: int, seq: int) -> dict[str, Any]:
    """Compile a Llama-style model under ``pipeline`` on a (dp=2, tp=2) mesh, take two steps, profile
    the third. Returns, on this rank, the main thread's collective issues and waits and its compute
    kernels (start and end in microseconds, in time order), the spans gloo's worker threads spent
    running collectives (``gloo:all_gather`` ...), and the three losses."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    mesh = device_mesh((2, 2), ("dp", "tp"))
    net = LlamaTiny(vocab=256, hidden=hidden, intermediate=2 * hidden)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))
    pm = parallelize(net, mesh, (ids, ids), plan="fsdp+tp", pipeline=pipeline)
    losses = []
    for _ in range(2):
        loss = pm(ids, ids)
        loss.backward()
        losses.append(float(loss))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = pm(ids, ids)
        loss.backward()
    losses.append(float(loss))
    main = [e for e in prof.events() if e.name == WAIT]
    thread = main[0].thread if main else None

    def spans(names: tuple[str, ...]) -> list[tuple[float, float]]:
        return sorted(
            (e.time_range.start, e.time_range.end) for e in prof.events() if e.name in names and e.thread == thread
        )

    return {
        "issues": spans(ISSUE),
        "waits": spans((WAIT,)),
        "compute": spans(COMPUTE),
        "losses": losses,
        "wire": sorted(
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.thread != thread and e.name.startswith("gloo:")
        ),
    }


def chunked_sequence_parallel(pipeline: str, steps: int = 2) -> dict[str, Any]:
    """Two AdamW steps of a 2-layer Llama of the overlap bench's width (hidden 512, batch 8 x seq 256),
    ``plan="auto"`` on (dp=2, tp=2) under ``pipeline``, beside single device: the loss, every
    gradient and the parameters agree (raises if not). Returns how many reduce-scatters the program
    runs on column chunks of a GEMM (``overlap{tp-chunks=k}``), how many all-gathers and
    reduce-scatters on nano-batches of tokens (``overlap{nano-batches=k}``), and the losses."""
    import dataclasses

    from meshfold.tools.bench.eager_vs_dtensor import Config, build
    from tests.dist.cases import EPS, LR, PARAM_ATOL, assert_step_matches

    warnings.filterwarnings("ignore")
    cfg = dataclasses.replace(Config(), layers=2, hidden=512, intermediate=1376, seq=256, batch=8)
    (net, inputs), (ref, _) = build(cfg), build(cfg)
    pm = parallelize(net, device_mesh((2, 2), ("dp", "tp")), inputs, plan="auto", pipeline=pipeline)

    def pieces(name: str, mark: str) -> int:
        hit = re.compile(rf"_{mark}\d+(_|$)")
        return sum(1 for op in pm.graph().ops if op.name == name and any(hit.search(r.name) for r in op.results))

    counts = {
        "chunked_scatters": pieces("comm.reduce_scatter", "c"),
        "nano_gathers": pieces("comm.all_gather", "n"),
        "nano_scatters": pieces("comm.reduce_scatter", "n"),
    }
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS) for m in (pm, ref))
    losses = []
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pm(*inputs)
        loss.backward()
        ref_loss = ref(*inputs)
        ref_loss.backward()
        assert_step_matches(pm, loss, ref, ref_loss, step=step)
        opt.step()
        ref_opt.step()
        losses.append(float(loss))
    want = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.detach().full_tensor(), want[name].detach(), rtol=0, atol=PARAM_ATOL, msg=name)
    return {**counts, "losses": losses}
