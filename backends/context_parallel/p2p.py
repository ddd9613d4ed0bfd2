"""Point-to-point exchanges within a process group: send some tensors to one rank and receive as
many like them from another (or the same), asynchronously; what ring attention, TokenRing and a
flip along a split dim are made of."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

Pending = tuple[list[Any], list[torch.Tensor]]
"""An exchange under way: its works and the tensors it receives into."""


def start(
    group: dist.ProcessGroup,
    send: list[torch.Tensor],
    to: int,
    frm: int,
    tag: int = 0,
    receive: list[torch.Tensor] | None = None,
) -> Pending:
    """Send ``send`` to rank ``to`` of ``group`` and receive tensors like them (or into ``receive``)
    from rank ``frm`` (ranks within the group). Empty tensors are neither sent nor received: both
    sides know their shapes."""
    got = [torch.empty_like(t) for t in send] if receive is None else receive
    there, here = dist.get_global_rank(group, to), dist.get_global_rank(group, frm)
    ops = [dist.P2POp(dist.isend, t.contiguous(), there, group, tag) for t in send if t.numel()]
    ops += [dist.P2POp(dist.irecv, x, here, group, tag) for x in got if x.numel()]
    return (dist.batch_isend_irecv(ops) if ops else []), got


def finish(pending: Pending) -> list[torch.Tensor]:
    """Wait for an exchange; the tensors it received."""
    works, got = pending
    for w in works:
        w.wait()
    return got
