"""Each rank's programs for Ascend NPUs: torch_npu tensors, HCCL groups, torchair's graph mode (GE).

:func:`ge_lowered` turns a rank's lowered forward and backward modules (``backends/eager.py``, made
plain as for Inductor: ``backends/traceable.py``) into the ATen graphs torchair converts to a GE
graph: each is traced with fake tensors of the rank's local shapes (from the IR's layouts), the
Python helpers the eager modules call traced into the ops they run, and every op with no GE
converter in torchair decomposed, with torch's own decompositions, into ops that have one. The
collectives stay ``torch.ops._c10d_functional`` calls: torchair converts ``all_reduce`` (sum, min,
max, product), ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast`` and
``wait_tensor`` to HCCL ops, and its default decompositions turn ``all_to_all_single`` into its
``all_to_all_single_npu`` op; the groups are the mesh's HCCL groups (``init_device_mesh("npu", ...)``).

Which ops torchair converts is a fact table, ``torchair_converters.txt``, generated from torchair's
sources (``python -m meshfold.tools.torchair_facts``, which records the commit): an op left with no
converter after the decompositions is reported when the program is lowered, before anything runs,
naming the op it came from, its module path and source line. So is a collective whose reduction GE
has no form for.

CPU attention (``_scaled_dot_product_flash_attention_for_cpu``, what capture on a CPU model
records) lowers to matrix products and a softmax, its backward by :func:`_attention_backward`:
correct, not fused (torchair's ``npu_fusion_attention`` would be).

:func:`graph_mode` then compiles each traced module with ``torch.compile`` and torchair's NPU
backend in ``max-autotune`` mode (whole-graph GE compilation). It needs ``torch_npu`` and
``torchair``; ``ge_lowered`` needs neither, so the lowering's output is checked on any machine
(golden files, the fact table, and a run of the traced graphs on CPU ranks equal to one device).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from meshfold.backends.eager import OP_META, Lowered, RankContext
from meshfold.backends.phases import phases
from meshfold.backends.traceable import EXCHANGE, plain
from meshfold.ir import Graph, Value
from meshfold.passes.base import PassError

CONVERTERS = Path(__file__).with_name("torchair_converters.txt")
REDUCTIONS = ("sum", "min", "max", "product")
"""The reductions torchair converts to HCCL (``normalize_reduceop_type``)."""
_CANNOT = "backend='ascend' cannot lower"
_ADVICE = "Use backend='eager' for this model and plan"
_ORIGIN = "meshfold_op"

aten = torch.ops.aten


@functools.cache
def converters() -> tuple[str, frozenset[str]]:
    """(the table's source line, the ops torchair's graph mode converts)."""
    lines = CONVERTERS.read_text().splitlines()
    return lines[0].lstrip("# "), frozenset(line for line in lines if line and not line.startswith("#"))


def _scores(
    q: torch.Tensor, k: torch.Tensor, is_causal: bool, attn_mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """Attention scores in float32, key heads repeated for grouped-query attention, masked."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    k = k.float().repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q.float() @ k.transpose(-2, -1) * scale
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2])
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores


def _no_dropout(dropout_p: float) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError("attention with dropout has no decomposition for graph mode")


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention's output and log-sum-exp (batch, heads, queries) from matrix products and
    a softmax (torch's decomposition returns the log-sum-exp in another shape)."""
    _no_dropout(dropout_p)
    scores = _scores(q, k, is_causal, attn_mask, scale)
    lse = scores.logsumexp(-1)
    v = v.float().repeat_interleave(q.shape[1] // v.shape[1], 1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v
    return out.to(q.dtype), lse


def _attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of CPU flash attention from its saved log-sum-exp: the probabilities
    recomputed as ``exp(scores - lse)``, then the softmax's backward (torch has no decomposition)."""
    _no_dropout(dropout_p)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    kv_heads, group = k.shape[1], q.shape[1] // k.shape[1]
    probs = torch.exp(_scores(q, k, is_causal, attn_mask, scale) - lse.float().unsqueeze(-1))
    grad = grad.float()
    grad_v = probs.transpose(-2, -1) @ grad
    grad_probs = grad @ v.float().repeat_interleave(group, 1).transpose(-2, -1)
    grad_scores = probs * (grad_probs - (grad * out.float()).sum(-1, keepdim=True))
    grad_q = grad_scores @ k.float().repeat_interleave(group, 1) * scale
    grad_k = grad_scores.transpose(-2, -1) @ q.float() * scale
    if group > 1:  # NOTE: a key head's gradient sums over the query heads it served
        grad_k = grad_k.unflatten(1, (kv_heads, group)).sum(2)
        grad_v = grad_v.unflatten(1, (kv_heads, group)).sum(2)
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _amax(x: torch.Tensor, dim: Sequence[int] = (), keepdim: bool = False) -> torch.Tensor:
    """``amax`` as a ``max`` over one dim at a time (torch decomposes it into a prim GE cannot take)."""
    dims = sorted({d % x.dim() for d in dim} if dim else range(x.dim()), reverse=True)
    for d in dims:
        x = x.max(d, keepdim=True).values
    return x if keepdim else x.squeeze(dims) if dims else x


def _decompositions(known: frozenset[str]) -> dict[Any, Callable[..., Any]]:
    """torch's decompositions into core ATen ops of the ops torchair has no converter for, and ours
    where torch has none that ends in ops GE converts."""
    from torch._decomp import core_aten_decompositions

    table = {op: fn for op, fn in core_aten_decompositions().items() if str(op) not in known}
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = _attention
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _attention_backward
    table[aten.amax.default] = _amax
    return table


_LABELS = (
    torch.ops.profiler._record_function_exit._RecordFunction,
    torch.ops.profiler._record_function_exit.default,
    torch.ops.profiler._record_function_enter_new.default,
)
"""Profiler labels (``record_function``) a traced helper leaves: GE converts none, they compute nothing."""


def _drop_labels(traced: fx.GraphModule) -> None:
    for target in _LABELS:
        for node in [n for n in traced.graph.nodes if n.target == target]:
            traced.graph.erase_node(node)
    traced.recompile()


def _fakes(values: Sequence[Value], rank: RankContext, mode: Any, device: torch.device) -> list[torch.Tensor]:
    """Fake tensors of ``values``' local shapes on this rank."""
    with mode:
        return [
            torch.empty(
                v.layout.local_shape(v.type.shape, rank.mesh, rank.coordinate), dtype=v.type.dtype, device=device
            )
            for v in values
        ]


def _origin(node: fx.Node) -> str:
    origin = (node.meta.get("custom") or {}).get(_ORIGIN)
    return origin if origin is not None else f"a node of the lowered program ({node.name})"


def ge_module(module: fx.GraphModule, inputs: Sequence[torch.Tensor], mode: Any, what: str) -> fx.GraphModule:
    """``module`` traced on ``inputs`` (fake tensors of ``mode``) into the ops torchair converts; raises ``PassError``
    naming the op, module path and source line of the first op left without a converter."""
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    source, known = converters()
    flat = plain(module, _CANNOT, _ADVICE, exchange_op=False, refused=EXCHANGE)
    for node in flat.graph.nodes:
        op = node.meta.get(OP_META)
        if op is not None:
            # NOTE: "custom" is a meta field make_fx copies from the node being run to the nodes it traces
            node.meta["custom"] = {_ORIGIN: op.describe()}
    # NOTE: under ``mode``, so the tensors a decomposition makes (a causal mask) are fake too
    with mode, fx_traceback.preserve_node_meta():
        traced = make_fx(fx.Interpreter(flat).run, decomposition_table=_decompositions(known))(*inputs)
    _drop_labels(traced)
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        name = str(node.target) if isinstance(node.target, torch._ops.OpOverload) else repr(node.target)
        if name not in known:
            raise PassError(
                f"{_CANNOT} {_origin(node)} in {what}: it runs {name}, which torchair's graph mode has no converter "
                f"for ({source}). {_ADVICE}"
            )
        reduce = node.args[1] if name.endswith(("all_reduce.default", "reduce_scatter_tensor.default")) else None
        if reduce is not None and reduce not in REDUCTIONS:
            raise PassError(
                f"{_CANNOT} {_origin(node)} in {what}: GE has no {reduce!r} reduction for {name} "
                f"(HCCL reduces by {', '.join(REDUCTIONS)}). {_ADVICE}"
            )
    return traced


def ge_lowered(graph: Graph, low: Lowered, rank: RankContext, device: torch.device | str = "cpu") -> Lowered:
    """``low`` (lowered from ``graph`` for ``rank``) with its forward and backward traced into the
    ATen graphs torchair converts (``ge_module``), on fake tensors of ``device``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if low.weights is not None:
        raise PassError(f"{_CANNOT} a pipeline stage whose backward is split in two (zero-bubble). {_ADVICE}")
    ph = phases(graph)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    device = torch.device(device)
    inputs = {i.name: i.value for i in graph.inputs}
    forward = ge_module(
        low.forward, _fakes([inputs[n] for n in low.fwd_inputs], rank, mode, device), mode, "the forward"
    )
    backward_inputs = _fakes([*ph.saved, *(i.value for i in ph.tangents)], rank, mode, device)
    backward = ge_module(low.backward, backward_inputs, mode, "the backward")
    return replace(low, forward=forward, backward=backward)


def graph_mode(low: Lowered, what: str) -> Lowered:
    """``low``'s traced modules compiled by ``torch.compile`` with torchair's NPU backend in
    ``max-autotune`` mode (GE graph mode), each on its first call. Raises ``PassError`` when
    ``torch_npu`` or ``torchair`` cannot be imported."""
    try:
        import torch_npu  # noqa: F401  # NOTE: registers the NPU device and HCCL
        import torchair
    except ImportError as e:
        raise PassError(
            f"backend='ascend' needs torch_npu and torchair (with the CANN toolkit) for {what}: {e}. "
            "Install them on the Ascend machine, or use backend='eager' or 'inductor' elsewhere"
        ) from e
    config = torchair.CompilerConfig()
    config.mode = "max-autotune"
    npu_backend = torchair.get_npu_backend(compiler_config=config)

    def compiled(module: fx.GraphModule) -> Any:
        return torch.compile(module, backend=npu_backend, fullgraph=True, dynamic=False)

    return replace(low, forward=compiled(low.forward), backward=compiled(low.backward))
