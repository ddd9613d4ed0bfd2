"""Mixture-of-experts ops: the routed experts of one MoE layer as ONE op, forward and backward.

``meshfold.moe_experts(hidden, top_k_index, top_k_weights, w_gate_up, w_down, act, ...)`` is what
every MoE layer computes once its router has chosen: each token ``t`` goes to experts
``top_k_index[t, :]``; expert ``e`` computes ``act(x Wg_e^T) * (x Wu_e^T)`` then ``· Wd_e^T`` (a
gated MLP; ``w_gate_up[e] = [Wg_e, Wu_e]``, ``[E, 2, I, H]``: the usual ``[E, 2I, H]`` weight viewed
so that splitting ``I`` keeps each rank's gate and up rows together), and the token's output is the
sum of its experts' outputs weighted by ``top_k_weights[t, :]``. Dispatch (grouping tokens by expert), the
grouped GEMMs and the combine are inside the op, so the rest of the graph only sees tokens in and
tokens out, and a layout can say "experts sharded" (``w_* S(0)``) without naming a ragged buffer.

Dropless: every routed token is computed. The backward is its own op
(``meshfold.moe_experts_backward``), so joint graphs carry both halves. ``experts(...)`` is the
autograd-aware call for model code (the marker API: MoE code meshfold does not recognize can call it
to be folded). ``experts_range`` computes only experts ``[lo, lo + n)`` — one rank's share when the
expert weights are sharded; every other token row is zero, so shares sum to the whole. A rank's
lowered program calls it as the ops ``meshfold.moe_experts_range`` and its backward
(``backends/experts/ranged.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from meshfold.ir.graph import Op
from meshfold.ir.placement import Shard

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _act_backward(act: str, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    aten = torch.ops.aten
    if act == "silu":
        out = aten.silu_backward(grad, x)
    elif act in ("gelu", "gelu_tanh"):
        out = aten.gelu_backward(grad, x, approximate="tanh" if act == "gelu_tanh" else "none")
    else:
        out = aten.threshold_backward(grad, x, 0)
    assert isinstance(out, torch.Tensor)
    return out


def _check(hidden: torch.Tensor, idx: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, act: str) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"moe_experts: unknown activation {act!r}; known: {', '.join(ACTIVATIONS)}")
    if hidden.dim() != 2 or idx.dim() != 2 or idx.size(0) != hidden.size(0):
        raise ValueError(f"moe_experts: hidden must be [T, H] and top_k_index [T, k]; got {hidden.shape}, {idx.shape}")
    if w_gate_up.dim() != 4 or w_down.dim() != 3 or w_gate_up.size(1) != 2 or w_gate_up.size(2) != w_down.size(2):
        raise ValueError(
            f"moe_experts: w_gate_up must be [E, 2, I, H] and w_down [E, H, I]; got {w_gate_up.shape}, {w_down.shape}"
        )


def capacity_of(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Per-expert capacity for ``factor`` (0: dropless), over all ``tokens`` of the op's input."""
    return 0 if factor <= 0 else math.ceil(tokens * k / num_experts * factor)


def kept(experts: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, capacity: int, policy: str) -> torch.Tensor:
    """Which (token, choice) pairs an expert computes when it takes at most ``capacity`` of them:
    by ``policy`` "probs" its highest routing weights, "position" its earliest tokens (ties go to the
    earlier position). ``pos`` is each pair's row-major position in the whole batch."""
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity <= 0:
        return keep
    order = torch.argsort(pos, stable=True)
    if policy.split("+")[0] == "probs":
        order = order[torch.argsort(-weights[order], stable=True)]
    ranked = experts[order]
    # NOTE: rank of each pair among its expert's pairs in policy order
    by_expert = torch.argsort(ranked, stable=True)
    counts = torch.bincount(ranked)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.empty_like(by_expert)
    rank_in_expert[by_expert] = torch.arange(len(by_expert)) - starts[ranked[by_expert]]
    keep[order] = rank_in_expert < capacity
    return keep


ROWS = 512
"""Pairs an expert computes at once. Its GEMMs' temporaries (gate, up, their product and, in the
backward, their gradients) exist for at most this many rows at a time, so the op's working set does
not grow with the tokens it is given (a budget may ask an op for fewer: ``piece_rows``);
``ir.dialects.moe_memory`` prices what that holds."""


def _pieces(local: torch.Tensor, e: int, rows: int) -> tuple[torch.Tensor, ...]:
    """Pair rows of expert ``e``, in pieces of at most ``rows`` (0: ``ROWS``)."""
    return torch.split(torch.where(local == e)[0], rows or ROWS)


def piece_rows(op: Op) -> int:
    """The pairs a routed-experts op computes at once: its ``rows`` keyword (the memory pass sets
    it to fit a budget), else ``ROWS``."""
    rows = op.kwarg("rows")
    return int(rows) if isinstance(rows, int) and rows > 0 else ROWS


def with_rows(op: Op, rows: int) -> Op:
    """``op`` (a routed-experts op) computing ``rows`` pairs at a time; same operands and results."""
    kwargs = tuple((k, v) for k, v in op.kwargs if k != "rows") + ((("rows", rows),) if rows != ROWS else ())
    return replace(op, kwargs=kwargs)


def pair_outputs(
    local: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    tok: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    rows: int = 0,
) -> torch.Tensor:
    """``w * expert(x)`` per (token, choice) pair; ``local`` indexes the given experts' weights.
    Pair ``i`` reads row ``tok[i]`` of ``x`` and adds its result into row ``tok[i]`` of ``out`` (both
    None: row ``i`` of ``x``, and a new buffer of one row per pair), ``rows`` pairs at a time (0:
    ``ROWS``)."""
    if out is None:
        out = x.new_zeros((len(local), x.size(1)))
    fn = ACTIVATIONS[act]
    for e in range(w_down.size(0)):
        for piece in _pieces(local, e, rows):
            at = piece if tok is None else tok[piece]
            xe = x[at]
            o = (fn(xe @ w_gate_up[e, 0].t()) * (xe @ w_gate_up[e, 1].t())) @ w_down[e].t()
            out.index_add_(0, at, (o * w[piece, None]).to(out.dtype))
            del xe, o  # NOTE: one piece's temporaries at a time
    return out


def pair_grads(
    local: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    dy: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    tok: torch.Tensor | None = None,
    dx: torch.Tensor | None = None,
    rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`pair_outputs` given each pair's incoming ``dy``: per pair d_w, d_x (added
    into row ``tok[i]`` of ``dx``, as ``pair_outputs`` reads ``x``), and the given experts'
    d_gate_up and d_down (summed over their pairs)."""
    if dx is None:
        dx = x.new_zeros((len(local), x.size(1)))
    dw = torch.zeros_like(w)
    d_gate_up, d_down = torch.zeros_like(w_gate_up), torch.zeros_like(w_down)
    fn = ACTIVATIONS[act]
    for e in range(w_down.size(0)):
        wg, wu = w_gate_up[e, 0], w_gate_up[e, 1]
        for piece in _pieces(local, e, rows):
            at = piece if tok is None else tok[piece]
            xe, dye = x[at], dy[at]
            g, u = xe @ wg.t(), xe @ wu.t()
            a = fn(g)
            z = a * u
            o = z @ w_down[e].t()
            dw[piece] = (dye * o).sum(-1).to(dw.dtype)
            do = dye * w[piece, None].to(dye.dtype)
            d_down[e] += do.t() @ z
            dz = do @ w_down[e]
            dg, du = _act_backward(act, dz * u, g), dz * a
            d_gate_up[e, 0] += dg.t() @ xe
            d_gate_up[e, 1] += du.t() @ xe
            dx.index_add_(0, at, dg @ wg + du @ wu)
            del xe, dye, g, u, a, z, o, do, dz, dg, du  # NOTE: one piece's temporaries at a time
    return dx, dw, d_gate_up, d_down


def _my_pairs(
    lo: int, idx: torch.Tensor, weights: torch.Tensor, n_local: int, capacity: int, policy: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, choice, local expert) of the pairs experts ``[lo, lo + n_local)`` compute."""
    flat = idx.reshape(-1)
    keep = kept(flat, torch.arange(flat.numel()), weights.reshape(-1), capacity, policy)
    sel = torch.where(keep & (flat >= lo) & (flat < lo + n_local))[0]
    k = idx.size(1)
    return sel // k, sel % k, flat[sel] - lo


def experts_range(
    lo: int,
    hidden: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    capacity: int = 0,
    policy: str = "probs",
    dispatcher: str = "any",
    rows: int = 0,
) -> torch.Tensor:
    """The experts' output for experts ``[lo, lo + len(w_down))`` (the weights given), zero elsewhere.
    ``capacity`` (0: dropless) is judged over every token given, as on one device; ``rows`` pairs
    are computed at a time (0: ``ROWS``)."""
    tok, slot, local = _my_pairs(lo, idx, weights, w_down.size(0), capacity, policy)
    w = weights[tok, slot]
    return pair_outputs(local, hidden, w, w_gate_up, w_down, act, tok=tok, out=torch.zeros_like(hidden), rows=rows)


def experts_range_backward(
    lo: int,
    grad: torch.Tensor,
    hidden: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    capacity: int = 0,
    policy: str = "probs",
    dispatcher: str = "any",
    rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`experts_range` w.r.t. hidden, weights, w_gate_up, w_down (the given experts')."""
    tok, slot, local = _my_pairs(lo, idx, weights, w_down.size(0), capacity, policy)
    dx = torch.zeros_like(hidden)
    d_weights = torch.zeros_like(weights)
    w = weights[tok, slot]
    _, dw, d_gate_up, d_down = pair_grads(local, hidden, w, grad, w_gate_up, w_down, act, tok=tok, dx=dx, rows=rows)
    d_weights[tok, slot] = dw
    return dx, d_weights, d_gate_up, d_down


# NOTE: the ops' non-tensor arguments, after the five tensors: activation, per-expert capacity
# (0: dropless), drop policy ("probs" | "position") and the dispatcher the plan asked for
# ("any" | "allgather" | "alltoall"; it only narrows the sharding choices, never the result).
POLICIES = ("probs", "position", "probs+pad", "position+pad")
"""``+pad``: the all-to-all moves every rank's pairs in buffers of exactly ``capacity`` rows per
expert (static splits, no count exchange); results are the same."""


@torch.library.custom_op("meshfold::moe_experts", mutates_args=())
def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    capacity: int,
    policy: str,
    dispatcher: str,
    rows: int = 0,
) -> torch.Tensor:
    """Routed experts of one MoE layer (see the module docstring); ``rows``: pairs computed at a
    time (0: ``ROWS``), which bounds the working set and never changes the result."""
    _check(hidden, top_k_index, w_gate_up, w_down, act)
    return experts_range(0, hidden, top_k_index, top_k_weights, w_gate_up, w_down, act, capacity, policy, rows=rows)


@moe_experts.register_fake
def _moe_experts_fake(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    *options: object,
    rows: int = 0,
) -> torch.Tensor:
    _check(hidden, top_k_index, w_gate_up, w_down, act)
    return torch.empty_like(hidden)


@torch.library.custom_op("meshfold::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    capacity: int,
    policy: str,
    dispatcher: str,
    rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``moe_experts`` w.r.t. hidden, top_k_weights, w_gate_up and w_down."""
    return experts_range_backward(
        0, grad, hidden, top_k_index, top_k_weights, w_gate_up, w_down, act, capacity, policy, rows=rows
    )


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(
    grad: torch.Tensor, *tensors_and_options: object, rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, _, weights, w_gate_up, w_down = tensors_and_options[:5]
    assert all(isinstance(t, torch.Tensor) for t in (hidden, weights, w_gate_up, w_down))
    return tuple(torch.empty_like(t) for t in (hidden, weights, w_gate_up, w_down))  # type: ignore[arg-type, return-value]


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    tensors, options = inputs[:5], inputs[5:]
    ctx.save_for_backward(*[t for t in tensors if isinstance(t, torch.Tensor)])
    ctx.options = options  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    hidden, idx, weights, w_gate_up, w_down = ctx.saved_tensors  # type: ignore[attr-defined]
    options = ctx.options  # type: ignore[attr-defined]
    # NOTE: (act, capacity, policy, dispatcher) as given; ``rows`` by keyword and only when set, so a
    # captured backward reads like its forward
    rows = {"rows": options[4]} if len(options) > 4 and options[4] else {}
    dh, dw, dgu, dd = torch.ops.meshfold.moe_experts_backward(
        grad, hidden, idx, weights, w_gate_up, w_down, *options[:4], **rows
    )
    return dh, None, dw, dgu, dd, *(None for _ in options)


moe_experts.register_autograd(_backward, setup_context=_setup)

EXPERTS = torch.ops.meshfold.moe_experts.default
EXPERTS_BACKWARD = torch.ops.meshfold.moe_experts_backward.default


def experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str = "silu",
    capacity_factor: float = 0.0,
    policy: str = "probs",
    dispatcher: str = "any",
) -> torch.Tensor:
    """Call the routed experts from model code: ``hidden [T, H]``, ``top_k_index``/``top_k_weights``
    ``[T, k]``, ``w_gate_up [E, 2I, H]`` (gate rows first) or ``[E, 2, I, H]``, ``w_down [E, H, I]``.
    Differentiable; meshfold can shard
    the experts of every layer written this way. ``capacity_factor`` > 0 drops the pairs beyond
    ``ceil(T * k / E * factor)`` per expert, chosen by ``policy``; 0 is dropless."""
    if policy not in POLICIES:
        raise ValueError(f"moe_experts: drop policy {policy!r}; use one of {', '.join(POLICIES)}")
    if w_gate_up.dim() == 3:  # NOTE: [E, 2I, H] with gate rows first, as transformers stores it
        w_gate_up = w_gate_up.view(w_gate_up.size(0), 2, w_gate_up.size(1) // 2, w_gate_up.size(2))
    cap = capacity_of(hidden.size(0), top_k_index.size(1), w_down.size(0), capacity_factor)
    out = torch.ops.meshfold.moe_experts(
        hidden, top_k_index, top_k_weights, w_gate_up, w_down, act, cap, policy, dispatcher
    )
    assert isinstance(out, torch.Tensor)
    return out


def exchange_axes(op: Op) -> tuple[str, ...]:
    """Mesh axes over which a routed-experts op (forward or backward) splits its tokens and its
    experts alike: its lowering exchanges tokens over them (the all-to-all dispatcher). Other ops: ()."""
    at = TOKENS_AND_WEIGHTS.get(op.target)
    if at is None:
        return ()
    t, w = op.operands[at[0]].layout, op.operands[at[1]].layout
    return tuple(a for a in t.axes if t.placement(a) == Shard(0) and w.placement(a) == Shard(0))


TOKENS_AND_WEIGHTS: dict[object, tuple[int, int]] = {EXPERTS: (0, 3), EXPERTS_BACKWARD: (1, 4)}
"""Operand positions of the tokens (hidden) and of ``w_gate_up`` in each routed-experts op."""
