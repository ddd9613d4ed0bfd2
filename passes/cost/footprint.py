"""Peak memory per device: parameters, gradients, optimizer state, activations, buffers.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), written per saved tensor so GQA, gated MLPs, MLA and MoE fall out of the
shapes: with sequence parallelism the tensors that live on the residual stream (norm inputs, the
norm outputs that feed column-parallel GEMMs, saved sharded and re-gathered in the backward) are
split over tp; everything inside attention and the MLP is split by the heads / columns it owns.
Without dropout and with fused attention a GPT layer saves ``s b h (32 / tp)`` bytes (their
``34 / tp`` minus the two dropout masks). ``selective`` recomputation drops the norm outputs and
the MLP activation output (and the score matrix when attention is unfused); ``full`` keeps only
each layer's input.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from meshfold.passes.cost.hardware import GIB, Cluster
from meshfold.passes.cost.model import Matmul, ModelSpec
from meshfold.passes.cost.parallel import ParallelConfig, TrainSpec
from meshfold.passes.cost.result import MemoryBreakdown

# NOTE: CUDA/CANN context (~0.5 GiB on Hopper), cuBLAS/cuDNN workspaces and NCCL channel buffers
# for a handful of communicators; PyTorch's caching allocator fragmentation is not modelled.
RUNTIME_RESERVE = 1.5 * GIB
# Megatron-LM distributed-data-parallel bucket: max(40M, 1M x dp) parameters (REFERENCES.md).
BUCKET_MIN = 40e6


@dataclass(frozen=True, slots=True)
class StageParams:
    """Parameters one device holds for one pipeline stage, before ZeRO sharding: ``dense`` are
    sharded over dp x cp by the distributed optimizer, ``expert`` over the expert data-parallel
    group."""

    dense: float
    expert: float

    @property
    def total(self) -> float:
        """All parameters of the stage on this device."""
        return self.dense + self.expert


def _split_params(model: ModelSpec, tp: int, matmuls: tuple[Matmul, ...]) -> float:
    total = 0.0
    for mm in matmuls:
        total += mm.params / (tp if mm.split in ("col", "row") else 1)
        if model.linear_bias:
            total += mm.n / tp if mm.split == "col" else mm.n
    return total


def stage_params(model: ModelSpec, cfg: ParallelConfig, stage: str) -> StageParams:
    """Per-device parameters of pipeline ``stage`` in {"first", "middle", "last"} (layers spread
    evenly; the embedding sits on the first stage, the final norm and LM head on the last)."""
    return _stage_params(model, cfg.tp, cfg.pp, cfg.ep * cfg.etp_size, stage)


@functools.lru_cache(maxsize=4096)
def _stage_params(model: ModelSpec, tp: int, pp: int, expert_split: int, stage: str) -> StageParams:
    """``stage_params`` from the sizes it depends on; experts are split over ``ep x etp``."""
    attn = _split_params(model, tp, model.attention_matmuls()) + 2 * model.norm_params()
    dense = attn + _split_params(model, tp, model.mlp_matmuls())
    moe_dense = attn + model.hidden * model.num_experts
    if model.shared_experts:
        moe_dense += _split_params(model, tp, model.mlp_matmuls(model.moe_ffn_hidden * model.shared_experts))
    experts = model.expert_params() / expert_split if model.num_experts else 0.0
    d = (model.dense_layers * dense + model.moe_layers * moe_dense) / pp
    e = model.moe_layers * experts / pp
    emb = model.vocab * model.hidden / tp
    if stage == "first" or pp == 1:
        d += emb + model.learned_positions * model.hidden
    if stage == "last" or pp == 1:
        d += model.norm_params()
        if not model.tied_embeddings or pp > 1:
            d += emb
    return StageParams(d, e)


def layer_activation_bytes(model: ModelSpec, cfg: ParallelConfig, train: TrainSpec, kind: str) -> float:
    """Bytes one layer of ``kind`` ("dense" / "moe") keeps per micro-batch for its backward."""
    a = train.act_bytes
    tp, h = cfg.tp, model.hidden
    T = cfg.micro_batch_size * train.seq_len / cfg.cp
    Tsp = T / tp if cfg.sp else T
    if cfg.recompute == "full":
        return Tsp * h * a
    keep_norm_out = cfg.recompute == "none"
    heads = model.heads / tp
    kv = heads if model.is_mla else model.n_kv_heads / tp
    elems = 2 * Tsp * h  # inputs of the two norms (residual stream)
    elems += (Tsp * h if keep_norm_out else 0.0) * 2  # norm outputs feeding the GEMMs
    if model.is_mla:
        elems += T * (model.q_lora_rank + model.kv_lora_rank + model.qk_rope_dim)
    elems += T * (heads * model.qk_head_dim + kv * (model.qk_head_dim + model.v_dim))  # q, k, v
    elems += T * heads * model.v_dim + T * heads * 4 / a  # attention output, fp32 log-sum-exp
    if not train.flash_attention and cfg.recompute == "none":
        elems += T * train.seq_len * heads  # softmax probabilities
    up = 2 if model.gated_mlp else 1

    def mlp(width: float, tokens: float, split: int) -> float:
        return tokens * width * up / split + (tokens * width / split if keep_norm_out else 0.0)

    if kind == "moe":
        rows = Tsp * model.top_k * model.routing_imbalance * cfg.etp_size
        elems += Tsp * model.num_experts * 4 / a + 2 * rows * h + mlp(model.moe_ffn_hidden, rows, cfg.etp_size)
        if model.shared_experts:
            elems += mlp(model.moe_ffn_hidden * model.shared_experts, T, tp)
    else:
        elems += mlp(model.ffn_hidden, T, tp)
    return elems * a


def chunks_in_flight(cfg: ParallelConfig, m: int, stage: str) -> int:
    """Micro-batch chunks whose activations a stage holds at its peak under (interleaved) 1F1B."""
    if cfg.pp == 1:
        return 1
    if cfg.vpp == 1:
        return min(m, cfg.pp) if stage == "first" else 1
    warmup = 2 * (cfg.pp - 1) + (cfg.vpp - 1) * cfg.pp if stage == "first" else (cfg.vpp - 1) * cfg.pp
    return min(m * cfg.vpp, warmup + 1)


def memory_breakdown(
    model: ModelSpec, cluster: Cluster, cfg: ParallelConfig, train: TrainSpec, stage: str
) -> MemoryBreakdown:
    """Peak bytes on one device of pipeline ``stage`` ("first" or "last")."""
    a, w, g = train.act_bytes, train.weight_bytes, train.grad_bytes
    master = 4 if w < 4 else 0
    opt = (8 if train.optimizer == "adam" else 4) + master
    p = stage_params(model, cfg, stage)
    dshard, eshard = cfg.dp * cfg.cp, cfg.edp
    opt_bytes = opt * (p.dense / dshard + p.expert / eshard) if cfg.zero >= 1 else opt * p.total
    grads = g * (p.dense / dshard + p.expert / eshard) if cfg.zero >= 2 else g * p.total
    params = w * (p.dense / dshard + p.expert / eshard) if cfg.zero == 3 else w * p.total
    layers = model.layers / cfg.pp
    m = cfg.num_microbatches(train)
    per_chunk = (
        (
            model.dense_layers * layer_activation_bytes(model, cfg, train, "dense")
            + model.moe_layers * layer_activation_bytes(model, cfg, train, "moe")
        )
        / model.layers
        * layers
        / cfg.vpp
    )
    acts = chunks_in_flight(cfg, m, stage) * per_chunk
    T = cfg.micro_batch_size * train.seq_len / cfg.cp
    Tsp = T / cfg.tp if cfg.sp else T
    if cfg.recompute == "full":
        kind = "moe" if model.moe_layers else "dense"
        acts += layer_activation_bytes(model, replace(cfg, recompute="none"), train, kind)  # the layer in backward
    if stage == "last" or cfg.pp == 1:
        acts += T * model.vocab / cfg.tp * (a + 4)  # logits + fp32 softmax of the loss
    buffers = 0.0
    if cfg.tp > 1:
        buffers += 2 * T * model.hidden * a
    if cfg.pp > 1:
        buffers += 2 * Tsp * model.hidden * a
    if cfg.ep > 1 or cfg.etp_size > 1:
        buffers += 2 * Tsp * model.top_k * model.routing_imbalance * cfg.etp_size * model.hidden * a
    if cfg.cp > 1:
        buffers += 2 * T * model.n_kv_heads / cfg.tp * (model.qk_head_dim + model.v_dim) * a
    if cfg.zero >= 2:
        buffers += max(BUCKET_MIN, 1e6 * cfg.dp) * g
    if cfg.zero == 3:
        buffers += 2 * p.total / layers * w  # current and prefetched layer, unsharded
    return MemoryBreakdown(params, grads, opt_bytes, acts, buffers, RUNTIME_RESERVE)


@functools.lru_cache(maxsize=4096)
def peak_memory(model: ModelSpec, cluster: Cluster, cfg: ParallelConfig, train: TrainSpec) -> MemoryBreakdown:
    """The larger of the first and last pipeline stage's peaks (they bound every stage)."""
    first = memory_breakdown(model, cluster, cfg, train, "first")
    if cfg.pp == 1:
        return first
    last = memory_breakdown(model, cluster, cfg, train, "last")
    return first if first.total >= last.total else last
