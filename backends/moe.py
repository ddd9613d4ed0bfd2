"""The all-to-all dispatcher: routed experts with tokens AND experts split over the same ranks.

Each rank holds ``T/n`` tokens and the experts ``[lo_p, lo_p + size)`` of its peer slot ``p``. A
(token, choice) pair goes to the peer owning its expert: counts first (one all-to-all of ``n``
integers), then the pairs' rows with variable splits — dropless, nothing padded. The owner computes
its experts on what it received (applying the capacity, if any, over all pairs its experts got:
each pair carries its position in the whole batch, so drops match one device), and the results
travel back the same way; the source combines them into its tokens. The backward sends the
tokens and their incoming gradients out and brings ``d_hidden`` and ``d_weights`` back; expert
gradients stay with their owner (``S(0)``).

Pairs whose expert no peer in the group owns (experts also split over another mesh axis, where the
tokens are replicated) are left to the ranks that own it: the result is then ``P(sum)`` there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ir.moe import kept, pair_grads, pair_outputs


@dataclass(frozen=True)
class Peers:
    """The group the tokens are exchanged in: its name, this rank's slot, and each slot's experts
    ``[lo, lo + size)``."""

    group: str
    me: int
    los: tuple[int, ...]
    size: int


def _owner(peers: Peers, experts: torch.Tensor) -> torch.Tensor:
    """Peer slot owning each expert id, or -1."""
    owner = torch.full_like(experts, -1)
    for p, lo in enumerate(peers.los):
        owner[(experts >= lo) & (experts < lo + peers.size)] = p
    return owner


def _exchange(pg: dist.ProcessGroup, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=pg)
    return out


@dataclass(frozen=True)
class _Routed:
    """This rank's pairs in send order and what its peers sent it."""

    tok: torch.Tensor
    slot: torch.Tensor
    send: list[int]
    recv: list[int]
    local: torch.Tensor
    """Received pairs' expert, as an index into this rank's experts."""
    keep: torch.Tensor
    """Received pairs within capacity."""


def _route(
    peers: Peers, pg: dist.ProcessGroup, idx: torch.Tensor, weights: torch.Tensor, capacity: int, policy: str
) -> tuple[_Routed, torch.Tensor]:
    """Sort pairs by owner, exchange counts and (expert, batch position, weight); returns the routing
    and the received weights."""
    n = len(peers.los)
    t, k = idx.shape
    flat = idx.reshape(-1)
    owner = _owner(peers, flat)
    mine = torch.where(owner >= 0)[0]
    order = mine[torch.argsort(owner[mine] * (flat.max() + 1) + flat[mine], stable=True)]
    send = torch.bincount(owner[order], minlength=n)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    send_l, recv_l = send.tolist(), recv.tolist()
    pos = order + peers.me * t * k  # NOTE: row-major position in the whole batch (tokens split in slot order)
    meta = _exchange(pg, torch.stack((flat[order], pos), dim=1), send_l, recv_l)
    w_in = _exchange(pg, weights.reshape(-1)[order], send_l, recv_l)
    keep = kept(meta[:, 0], meta[:, 1], w_in, capacity, policy)
    local = meta[:, 0] - peers.los[peers.me]
    return _Routed(order // k, order % k, send_l, recv_l, local, keep), w_in


def exchange_forward(
    group: str,
    me: int,
    los: tuple[int, ...],
    size: int,
    hidden: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    capacity: int = 0,
    policy: str = "probs",
    dispatcher: str = "alltoall",
) -> torch.Tensor:
    """``moe_experts`` on this rank's tokens, its experts computed for the whole group's tokens.
    ``group``/``me``/``los``/``size`` describe the peers (see :class:`Peers`)."""
    peers = Peers(group, me, tuple(los), size)
    pg = _resolve_process_group(peers.group)
    r, w_in = _route(peers, pg, idx, weights, capacity, policy)
    x_in = _exchange(pg, hidden[r.tok], r.send, r.recv)
    y = pair_outputs(torch.where(r.keep, r.local, -1), x_in, w_in, w_gate_up, w_down, act)
    back = _exchange(pg, y, r.recv, r.send)
    return torch.zeros_like(hidden).index_add_(0, r.tok, back)


def exchange_backward(
    group: str,
    me: int,
    los: tuple[int, ...],
    size: int,
    grad: torch.Tensor,
    hidden: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    capacity: int = 0,
    policy: str = "probs",
    dispatcher: str = "alltoall",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`exchange_forward`: hidden and weights for this rank's tokens, the expert
    weights' for its own experts."""
    peers = Peers(group, me, tuple(los), size)
    pg = _resolve_process_group(peers.group)
    r, w_in = _route(peers, pg, idx, weights, capacity, policy)
    h = hidden.size(1)
    rows_in = _exchange(pg, torch.cat((hidden[r.tok], grad[r.tok]), dim=1), r.send, r.recv)
    local = torch.where(r.keep, r.local, -1)
    dx, dw, d_gate_up, d_down = pair_grads(local, rows_in[:, :h], w_in, rows_in[:, h:], w_gate_up, w_down, act)
    back = _exchange(pg, torch.cat((dx, dw[:, None].to(dx.dtype)), dim=1), r.recv, r.send)
    d_weights = torch.zeros_like(weights)
    d_weights[r.tok, r.slot] = back[:, h].to(d_weights.dtype)
    return torch.zeros_like(hidden).index_add_(0, r.tok, back[:, :h]), d_weights, d_gate_up, d_down
