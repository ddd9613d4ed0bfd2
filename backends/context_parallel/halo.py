"""A causal convolution (``meshfold.causal_conv1d``) along a sequence split over a process group, in
rank order: each rank receives the last ``K - 1`` positions of the rank before it (the first rank:
zeros) and convolves its own part; the backward receives the first ``K - 1`` gradient positions of
the rank after it. One point-to-point exchange of ``B x C x (K - 1)`` numbers each way."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from meshfold.backends.context_parallel import p2p
from meshfold.ir.dialects.conv import conv, conv_back


def _neighbour(pg: dist.ProcessGroup, x: torch.Tensor, width: int, forward: bool) -> torch.Tensor:
    """The ``width`` positions of ``x`` on the rank before this one (``forward``: its last ones) or
    after it (its first ones); zeros at the ends of the group."""
    n, r = dist.get_world_size(pg), dist.get_rank(pg)
    if x.shape[-1] < width:
        raise ValueError(
            f"causal_conv1d: a rank's part of the sequence ({x.shape[-1]} positions) is shorter than the "
            f"convolution reaches back ({width}); use fewer ranks on the sequence or a longer one"
        )
    mine = x[..., x.shape[-1] - width :] if forward else x[..., :width]
    to, frm = (r + 1, r - 1) if forward else (r - 1, r + 1)
    send = mine.contiguous() if 0 <= to < n else mine.new_empty(0)
    got = mine.new_zeros(mine.shape)
    receive = got if 0 <= frm < n else got.new_empty(0)
    p2p.finish(p2p.start(pg, [send], to % n, frm % n, receive=[receive]))
    return got


def causal_conv1d_split(group: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``causal_conv1d(x, w, bias)`` on this rank's part of the sequence (split over ``group``)."""
    pg = _resolve_process_group(group)
    return conv(x, w, bias, _neighbour(pg, x, w.shape[-1] - 1, forward=True))


def causal_conv1d_backward_split(
    group: str, grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``causal_conv1d_backward`` on this rank's part: ``dx`` of its positions, and its share of
    ``dw`` and ``dbias`` (the ranks' shares add up)."""
    pg = _resolve_process_group(group)
    k = w.shape[-1]
    before = _neighbour(pg, x, k - 1, forward=True)
    after = _neighbour(pg, grad, k - 1, forward=False)
    return conv_back(grad, x, w, before, after)
