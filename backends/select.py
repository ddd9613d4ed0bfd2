"""How a rank's lowered program runs, by backend name (``parallelize(..., backend=)``)."""

from __future__ import annotations

import torch

from meshfold.backends.eager import Lowered, RankContext
from meshfold.ir import Graph


def select(backend: str, graph: Graph, lowered: Lowered, rank: RankContext, device: str, what: str) -> Lowered:
    """``lowered`` (from ``graph`` for ``rank``) as ``backend`` runs it: the eager modules (``"eager"``),
    Inductor's compile of them (``"inductor"``), or their GE graphs under torchair on ``device``'s
    tensors (``"ascend"``); ``what`` names the rank in errors. Each backend loads only when asked for."""
    if backend == "inductor":
        from meshfold.backends.inductor import compiled

        return compiled(lowered, what)
    if backend == "ascend":
        from meshfold.backends.ascend import ge_lowered, graph_mode

        return graph_mode(ge_lowered(graph, lowered, rank, torch.device(device)), what)
    return lowered
