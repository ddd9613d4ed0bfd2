"""The all-to-all dispatcher: routed experts with tokens AND experts split over the same ranks.

Each rank holds ``T/n`` tokens and the experts ``[lo_p, lo_p + size)`` of its peer slot ``p``. A
(token, choice) pair goes to the peer owning its expert: counts first (one all-to-all of ``n``
integers), then the pairs' rows with variable splits — dropless, nothing padded. Hierarchical, the
exchange over several mesh axes goes one axis at a time, innermost (inside a node) first, instead
of over one flat group. The owner computes its experts on what arrived (applying the capacity, if
any, over all pairs its experts got: each pair carries its position in the whole batch, so drops
match one device), and the results travel back the same way; the source combines them into its
tokens. The backward sends the tokens and their incoming gradients out and brings ``d_hidden``
and ``d_weights`` back; expert gradients stay with their owner (``S(0)``).

Pairs whose expert no peer in the group owns (experts also split over another mesh axis, where the
tokens are replicated) are left to the ranks that own it: the result is then ``P(sum)`` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from meshfold.ir.dialects.moe import kept, pair_grads, pair_outputs

Stage = tuple[str, int, int]
"""One hop of the exchange: (process group, its size, the stride of its digit in the peer slot)."""


class Peers(NamedTuple):
    """Who the tokens are exchanged with: the hops (one over a flat group, or, hierarchical, one
    per mesh axis from the innermost out), this rank's slot, and each slot's experts ``[lo, lo + size)``.
    A named tuple, as the exchange's first argument in a lowered fx graph: fx writes a named tuple
    into the module's code as a call of its class (it has no spelling for a dataclass)."""

    stages: tuple[Stage, ...]
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
class _Hop:
    """What one hop did, to undo it: the sort applied before sending, and the split sizes."""

    pg: dist.ProcessGroup
    order: torch.Tensor
    send: list[int]
    recv: list[int]


def _forward(
    peers: Peers, floats: torch.Tensor, ints: torch.Tensor, dest: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[_Hop]]:
    """Carry rows (``floats``, ``ints``) to their destination slots hop by hop; returns what arrived
    and the hops taken."""
    hops: list[_Hop] = []
    for group, n, stride in peers.stages:
        pg = _resolve_process_group(group)
        digit = (dest // stride) % n
        order = torch.argsort(digit, stable=True)
        send = torch.bincount(digit[order], minlength=n)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=pg)
        send_l, recv_l = send.tolist(), recv.tolist()
        floats = _exchange(pg, floats[order], send_l, recv_l)
        ints = _exchange(pg, ints[order], send_l, recv_l)
        dest = _exchange(pg, dest[order], send_l, recv_l)
        hops.append(_Hop(pg, order, send_l, recv_l))
    return floats, ints, hops


def _back(rows: torch.Tensor, hops: list[_Hop]) -> torch.Tensor:
    """Return rows along the hops, undoing each sort: they end in the order they were first sent."""
    for hop in reversed(hops):
        arrived = _exchange(hop.pg, rows, hop.recv, hop.send)
        rows = torch.empty_like(arrived)
        rows[hop.order] = arrived
    return rows


@dataclass(frozen=True)
class _Routed:
    """This rank's pairs (in its own order) and what arrived at it."""

    tok: torch.Tensor
    slot: torch.Tensor
    floats: torch.Tensor
    local: torch.Tensor
    """Arrived pairs' expert as an index into this rank's experts, -1 where over capacity."""
    weights: torch.Tensor
    hops: list[_Hop]
    at: torch.Tensor | None = None
    """With static splits: each pair's row in the buffers that travel (results come back there)."""

    def back(self, rows: torch.Tensor) -> torch.Tensor:
        """Results for this rank's pairs, in its own order."""
        out = _back(rows, self.hops)
        return out if self.at is None else out[self.at]


def _route(
    peers: Peers, idx: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, capacity: int, policy: str
) -> _Routed:
    """Send every (token, choice) pair, with ``rows`` (one per token) and its weight, expert id and
    position in the whole batch, to the rank owning its expert; apply the capacity there."""
    t, k = idx.shape
    flat = idx.reshape(-1)
    owner = _owner(peers, flat)
    mine = torch.where(owner >= 0)[0]
    padded = policy.endswith("+pad") and capacity > 0 and len(peers.stages) == 1
    if padded:
        # NOTE: a pair outside its rank's own first `capacity` for its expert (policy order) is outside
        # the whole batch's first `capacity` too: drop it here, so every buffer fits `capacity` rows
        pos = mine + peers.me * t * k
        mine = mine[kept(flat[mine], pos, weights.reshape(-1)[mine], capacity, policy)]
    mine = mine[torch.argsort(flat[mine], stable=True)]
    tok, slot = mine // k, mine % k
    pos = mine + peers.me * t * k  # NOTE: row-major position in the whole batch (tokens split in slot order)
    floats = torch.cat((rows[tok], weights.reshape(-1)[mine, None].to(rows.dtype)), dim=1)
    ints = torch.stack((flat[mine], pos), dim=1)
    if padded:
        arrived, ints, hops, at = _padded(peers, floats, ints, owner[mine], capacity)
    else:
        arrived, ints, hops = _forward(peers, floats, ints, owner[mine])
        at = None
    real = ints[:, 0] >= 0
    w_in = arrived[:, -1]
    keep = torch.zeros_like(real)
    keep[real] = kept(ints[real, 0], ints[real, 1], w_in[real], capacity, policy)
    local = torch.where(keep, ints[:, 0] - peers.los[peers.me], -1)
    return _Routed(tok, slot, arrived[:, :-1], local, w_in, hops, at)


def _padded(
    peers: Peers, floats: torch.Tensor, ints: torch.Tensor, owner: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, list[_Hop], torch.Tensor]:
    """One hop with static splits: to each peer, ``capacity`` rows per expert it owns, empty rows
    marked with expert -1. Returns what arrived, the hop, and each pair's row in the sent buffer."""
    ((group, n, _),) = peers.stages
    pg = _resolve_process_group(group)
    expert = ints[:, 0]
    local = expert - torch.tensor(peers.los)[owner]
    first = torch.searchsorted(expert, expert)  # NOTE: pairs are sorted by expert: rank within it
    row = (owner * peers.size + local) * capacity + (torch.arange(len(expert)) - first)
    rows = n * peers.size * capacity
    f = floats.new_zeros((rows, floats.size(1)))
    f[row] = floats
    i = torch.full((rows, 2), -1, dtype=ints.dtype)
    i[row] = ints
    split = [peers.size * capacity] * n
    hop = _Hop(pg, torch.arange(rows), split, split)
    return _exchange(pg, f, split, split), _exchange(pg, i, split, split), [hop], row


def exchange_forward(
    peers: Peers,
    hidden: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    capacity: int = 0,
    policy: str = "probs",
    dispatcher: str = "alltoall",
    rows: int = 0,
) -> torch.Tensor:
    """``moe_experts`` on this rank's tokens, its experts computed for the whole group's tokens
    (``peers``: who holds which of them)."""
    r = _route(peers, idx, weights, hidden, capacity, policy)
    y = pair_outputs(r.local, r.floats, r.weights, w_gate_up, w_down, act, rows=rows)
    return torch.zeros_like(hidden).index_add_(0, r.tok, r.back(y))


def exchange_backward(
    peers: Peers,
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
    rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`exchange_forward`: hidden and weights for this rank's tokens, the expert
    weights' for its own experts."""
    h = hidden.size(1)
    r = _route(peers, idx, weights, torch.cat((hidden, grad), 1), capacity, policy)
    dx, dw, d_gate_up, d_down = pair_grads(
        r.local, r.floats[:, :h], r.weights, r.floats[:, h:], w_gate_up, w_down, act, rows=rows
    )
    back = r.back(torch.cat((dx, dw[:, None].to(dx.dtype)), dim=1))
    d_weights = torch.zeros_like(weights)
    d_weights[r.tok, r.slot] = back[:, h].to(d_weights.dtype)
    return torch.zeros_like(hidden).index_add_(0, r.tok, back[:, :h]), d_weights, d_gate_up, d_down


# NOTE: the exchanges as opaque custom ops, for compilers that trace the program (``backends/inductor.py``):
# the tokens each peer sends are known only while it runs, but what the exchange returns has the
# shapes of its inputs, which is all the fake kernels say. The hops are flattened into lists.
@torch.library.custom_op("meshfold::moe_exchange", mutates_args=())
def moe_exchange(
    groups: str,
    sizes: list[int],
    strides: list[int],
    me: int,
    los: list[int],
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
    rows: int = 0,
) -> torch.Tensor:
    """:func:`exchange_forward` with its hops as three lists (the groups' names joined by commas)."""
    peers = _unflat(groups, sizes, strides, me, los, size)
    return exchange_forward(peers, hidden, idx, weights, w_gate_up, w_down, act, capacity, policy, dispatcher, rows)


@moe_exchange.register_fake
def _(groups, sizes, strides, me, los, size, hidden, idx, weights, w_gate_up, w_down, act, *rest):  # type: ignore[no-untyped-def]
    return torch.empty_like(hidden)


@torch.library.custom_op("meshfold::moe_exchange_backward", mutates_args=())
def moe_exchange_backward(
    groups: str,
    sizes: list[int],
    strides: list[int],
    me: int,
    los: list[int],
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
    rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`exchange_backward` with its hops as three lists (the groups' names joined by commas)."""
    return exchange_backward(
        _unflat(groups, sizes, strides, me, los, size),
        grad,
        hidden,
        idx,
        weights,
        w_gate_up,
        w_down,
        act,
        capacity,
        policy,
        dispatcher,
        rows,
    )


@moe_exchange_backward.register_fake
def _(groups, sizes, strides, me, los, size, grad, hidden, idx, weights, w_gate_up, w_down, *rest):  # type: ignore[no-untyped-def]
    return torch.empty_like(hidden), torch.empty_like(weights), torch.empty_like(w_gate_up), torch.empty_like(w_down)


EXCHANGE_OPS = {
    exchange_forward: torch.ops.meshfold.moe_exchange.default,
    exchange_backward: torch.ops.meshfold.moe_exchange_backward.default,
}
"""Each exchange function's custom op (its first argument, the hops, flattened: ``flat_exchange_args``)."""


def flat_exchange_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """An exchange function's arguments as its custom op takes them (the ``Peers`` flattened)."""
    peers, rest = args[0], args[1:]
    assert isinstance(peers, Peers)
    stages = peers.stages
    groups = ",".join(str(g) for g, _, _ in stages)
    flat = (groups, [int(n) for _, n, _ in stages], [int(s) for _, _, s in stages], peers.me, list(peers.los))
    return (*flat, peers.size, *rest)


def _unflat(groups: str, sizes: list[int], strides: list[int], me: int, los: list[int], size: int) -> Peers:
    """The ``Peers`` ``flat_exchange_args`` flattened."""
    return Peers(tuple(zip(groups.split(","), sizes, strides, strict=True)), me, tuple(los), size)
