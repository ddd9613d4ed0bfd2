"""Tasks for the Ascend lowering's rank tests: the GE graphs ``backends/ascend.py`` makes of each rank's
programs, run on CPU ranks in place of graph mode (which needs an NPU), and printed for golden files."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Iterator
from typing import Any

from meshfold.api import parallelize
from meshfold.backends import ascend
from meshfold.backends.eager import lower
from meshfold.passes import PassError
from meshfold.runtime.groups import MeshGroups
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build
from tests.dist.cases import equivalence


@contextlib.contextmanager
def _traced_graphs_run_on_cpu() -> Iterator[None]:
    """``backend="ascend"`` with its traced GE graphs run as they are (ATen ops on CPU) in place of
    torchair's graph mode, which needs torch_npu and an NPU."""
    was = ascend.graph_mode
    ascend.graph_mode = lambda low, what: low  # type: ignore[assignment]
    try:
        yield
    finally:
        ascend.graph_mode = was  # type: ignore[assignment]


def ge_equivalence(model: str, plan: str, moe: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``model`` two steps under ``backend="ascend"`` (its GE graphs run on CPU) beside one device."""
    with _traced_graphs_run_on_cpu():
        return equivalence(model, (2, 2), ("dp", "tp"), plan, moe=moe, backend="ascend")


def _group_ranks(text: str) -> str:
    """``text`` with each process group name in a collective's arguments replaced by its global ranks
    (names depend on how many groups a process made before; the ranks do not)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    def ranks(m: re.Match[str]) -> str:
        return f"{m.group(1)}'ranks{dist.get_process_group_ranks(_resolve_process_group(m.group(2)))}')"

    return re.sub(r"(_c10d_functional\.\w+\.default\(.*, )'([^']+)'\)", ranks, text)


def ge_graphs(model: str, plan: str) -> dict[str, Any]:
    """This rank's GE graphs (forward, backward) for ``model`` under ``plan`` on a (dp=2, tp=2) mesh,
    lowered as for HCCL, as code with group ranks in place of group names; and the ops they run."""
    warnings.filterwarnings("ignore")
    net, inputs = build(model)
    mesh = device_mesh((2, 2), ("dp", "tp"))
    program = parallelize(net, mesh, inputs, plan=plan)._mf_programs.first
    graph = program.graph
    assert graph.mesh is not None
    # NOTE: as on NPUs: all-gathers as HCCL runs them, not sent as gloo's all-to-alls
    rank = dataclasses.replace(MeshGroups.of(mesh, None).rank_context(graph.mesh, graph), gloo=False)
    ge = ascend.ge_lowered(graph, lower(graph, rank), rank)
    ops = sorted({str(n.target) for m in (ge.forward, ge.backward) for n in m.graph.nodes if n.op == "call_function"})
    return {
        "forward": _group_ranks(ge.forward.code.strip()),
        "backward": _group_ranks(ge.backward.code.strip()),
        "ops": ops,
    }


def ge_refused(kind: str) -> str:
    """Lower for Ascend a model whose program GE cannot take: MoE with experts over 4 ranks (the
    token exchange is no op torchair converts); return the error."""
    warnings.filterwarnings("ignore")
    net, inputs = build("mixtral-tiny")
    with _traced_graphs_run_on_cpu():
        try:
            parallelize(net, device_mesh((2, 2), ("dp", "tp")), inputs, plan="fsdp+tp", moe={"ep": 4}, backend="ascend")
        except PassError as e:
            return str(e)
    raise AssertionError(f"backend='ascend' lowered the {kind} program it cannot run")
