"""Tasks that profile one training step of a compiled model and report, from ``torch.profiler``, when
each collective was issued and waited for and when the rank computed in between."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from meshfold.api import parallelize
from meshfold.tools.zoo.models import LlamaTiny
from tests.dist.pool import device_mesh

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
