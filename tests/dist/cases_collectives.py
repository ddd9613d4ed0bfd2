"""Tasks for tests/dist/test_demo_collectives.py: the demo's collectives table against a profiler's count."""

from __future__ import annotations

import re
import warnings
from collections import Counter
from typing import Any

import torch

from meshfold.api import parallelize
from meshfold.backends.collectives import BY_ALL_TO_ALL
from meshfold.tools.demo import collectives_table, measured_step
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.profiled_collectives import group_labels, summarize
from meshfold.tools.zoo import build
from tests.dist.captures import shared_capture

# NOTE: the profiler names each collective's op and records its inputs' shapes and dtypes;
# (name prefix, kind, index of the input that is sent)
_PROFILED = {
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 0),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional::all_reduce": ("all_reduce", 0),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0),
    "c10d::alltoall_base_": ("all_to_all", 1),
}
_DTYPE_BYTES = {"float": 4, "double": 8, "long int": 8, "int": 4, "c10::Half": 2, "c10::BFloat16": 2, "bool": 1}


def _profiled(prof: Any) -> tuple[Counter[str], Counter[str]]:
    """Calls and bytes sent per kind, from the profiler's outermost event of each collective op (an
    all-to-all under ``backends.collectives``'s label of a gloo all-gather: that all-gather, its operand
    the ``1/n`` of the all-to-all's input that it repeats; of a gloo reduce-scatter: that
    reduce-scatter, its operand the all-to-all's input)."""
    calls: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    for e in prof.events():
        if e.name not in _PROFILED or _inside_a_collective(e):
            continue
        kind, i = _PROFILED[e.name]
        numel = 1
        for d in e.input_shapes[i]:
            numel *= d
        sent_for, over = _sent_for(e)
        if sent_for == "all_gather":
            kind, numel = sent_for, numel // over
        elif sent_for:
            kind = sent_for
        calls[kind] += 1
        sent[kind] += numel * _DTYPE_BYTES[e.input_dtypes[i]]
    return calls, sent


def _sent_for(e: Any) -> tuple[str, int]:
    """The collective ``e`` (an all-to-all) is sent for on gloo and its group's size, per its label;
    ("", 0) if none."""
    label = re.compile(re.escape(BY_ALL_TO_ALL).replace(r"\{\}", r"(\w+)", 1).replace(r"\{\}", r"(\d+)"))
    parent = e.cpu_parent
    while parent is not None:
        m = label.fullmatch(parent.name)
        if m:
            return m.group(1), int(m.group(2))
        parent = parent.cpu_parent
    return "", 0


def _inside_a_collective(e: Any) -> bool:
    """Whether ``e`` runs inside an outer collective event: the re-dispatch of the same op (a dispatch
    mode's inner call), or the eager op a functional collective calls (``all_to_all_single`` runs
    ``c10d::alltoall_base_``)."""
    parent = e.cpu_parent
    while parent is not None:
        if parent.name in _PROFILED:
            return True
        parent = parent.cpu_parent
    return False


def demo_table_matches_profiler(
    model: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, moe: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One measured training step under ``torch.profiler``: the demo's table (calls and bytes per kind,
    and its total) equals what the profiler saw the rank run."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh(tuple(shape), tuple(names))
    net, inputs = build(model)
    with shared_capture(f"zoo:{model}"):
        pm = parallelize(net, mesh, inputs, plan=plan, moe=moe)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        _, recorded = measured_step(pm, inputs, opt)
    rows = summarize(recorded, group_labels(mesh, {c.group for c in recorded}))
    _, total_in, _ = collectives_table(rows)
    table_calls: Counter[str] = Counter()
    table_bytes: Counter[str] = Counter()
    for r in rows:
        assert r.count > 0 and r.in_bytes > 0, r  # NOTE: no row for a layout change that runs nothing
        table_calls[r.kind] += r.count
        table_bytes[r.kind] += r.in_bytes
    calls, sent = _profiled(prof)
    assert table_calls == calls, (table_calls, calls)
    assert table_bytes == sent, (table_bytes, sent)
    assert total_in == sum(sent.values())
    return {"bytes": dict(sent), "calls": dict(calls), "groups": sorted({r.group for r in rows})}
