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

Each pipeline rank is priced on its own layers (``StageLayers``, from the stage split) and edges,
with the micro-batches the schedule keeps in flight on it (``chunks_in_flight``); ``StageMemory``
holds the per-layer figures so the split can ask whether a stage fits many times over.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from meshfold.sim.model import Matmul, ModelSpec
from meshfold.sim.parallel import ParallelConfig, TrainSpec
from meshfold.sim.result import MemoryBreakdown
from meshfold.target.hardware import GIB

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


@dataclass(frozen=True, slots=True)
class StageLayers:
    """What pipeline rank ``rank`` holds over all its virtual chunks: ``dense`` and ``moe`` layers,
    the embedding (on the rank of chunk 0) and the final norm, LM head and loss (``head``, on the
    rank of the last chunk)."""

    rank: int
    dense: int
    moe: int
    embedding: bool
    head: bool
    chunks: tuple[tuple[int, int], ...] = ()
    """(dense, MoE) layers of each of the rank's virtual chunks, in chunk order (empty: not known,
    taken as equal)."""

    @property
    def layers(self) -> int:
        """Transformer layers on the rank."""
        return self.dense + self.moe


def _split_params(model: ModelSpec, tp: int, matmuls: tuple[Matmul, ...]) -> float:
    total = 0.0
    for mm in matmuls:
        total += mm.params / (tp if mm.split in ("col", "row") else 1)
        if model.linear_bias:
            total += mm.n / tp if mm.split == "col" else mm.n
    return total


@functools.lru_cache(maxsize=4096)
def layer_params(model: ModelSpec, tp: int, expert_split: int, kind: str) -> StageParams:
    """Per-device parameters of one ``kind`` ("dense" / "moe") layer; experts split over ``ep x etp``."""
    attn = _split_params(model, tp, model.attention_matmuls()) + 2 * model.norm_params()
    if kind == "dense":
        return StageParams(attn + _split_params(model, tp, model.mlp_matmuls()), 0.0)
    dense = attn + model.hidden * model.num_experts
    if model.shared_experts:
        dense += _split_params(model, tp, model.mlp_matmuls(model.moe_ffn_hidden * model.shared_experts))
    return StageParams(dense, model.expert_params() / expert_split)


def edge_params(model: ModelSpec, tp: int, pp: int, embedding: bool, head: bool) -> float:
    """Per-device parameters of the pipeline edges a rank holds (the LM head shares the embedding's
    weight only when both sit on one rank and the model ties them)."""
    emb = model.vocab * model.hidden / tp
    d = emb + model.learned_positions * model.hidden if embedding else 0.0
    if head:
        d += model.norm_params()
        if not model.tied_embeddings or pp > 1:
            d += emb
    return d


def stage_params(model: ModelSpec, cfg: ParallelConfig, stage: StageLayers) -> StageParams:
    """Per-device parameters of pipeline rank ``stage`` (its layers and edges)."""
    split = cfg.ep * cfg.etp_size
    d, e = layer_params(model, cfg.tp, split, "dense"), layer_params(model, cfg.tp, split, "moe")
    dense = (
        stage.dense * d.dense + stage.moe * e.dense + edge_params(model, cfg.tp, cfg.pp, stage.embedding, stage.head)
    )
    return StageParams(dense, stage.moe * e.expert)


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


def chunks_in_flight(cfg: ParallelConfig, m: int, rank: int) -> int:
    """Micro-batch chunks whose activations pipeline rank ``rank`` holds at its peak: under 1F1B
    rank ``r`` runs ``pp - r - 1`` warm-up forwards, so it keeps ``min(pp - r, m)``; under
    interleaved 1F1B Megatron's warm-up is ``2 (pp - r - 1) + (vpp - 1) pp`` chunk-passes. ZB-H1
    keeps 1F1B's (its deferred weight gradients free their inputs within the same slot)."""
    return _in_flight(cfg.pp, cfg.vpp, m, rank)


def _in_flight(pp: int, vpp: int, m: int, rank: int) -> int:
    """``chunks_in_flight`` of a pipeline of ``pp`` ranks with ``vpp`` chunks each."""
    if pp == 1:
        return 1
    if vpp == 1:
        return min(m, pp - rank)
    return min(m * vpp, 2 * (pp - rank - 1) + (vpp - 1) * pp + 1)


@functools.lru_cache(maxsize=4096)
def peak_in_flight(pp: int, vpp: int, m: int, rank: int, chunk_bytes: tuple[float, ...]) -> float:
    """The most activation bytes pipeline rank ``rank`` holds at once when its chunk ``c`` keeps
    ``chunk_bytes[c]`` per micro-batch, walking Megatron's (interleaved) 1F1B order: the warm-up
    forwards of ``chunks_in_flight``, then one forward and one backward a slot; forward ``k`` runs
    chunk ``(k // pp) % vpp``, backward ``k`` chunk ``vpp - 1 - (k // pp) % vpp``. With equal
    chunks it is ``chunks_in_flight`` times one chunk's bytes; with unequal ones (a chunk that holds
    only the embedding) it counts what is held, not the mean."""
    total = m * vpp
    warm = _in_flight(pp, vpp, m, rank) - 1
    live = peak = 0.0
    done = 0
    for k in range(total):
        live += chunk_bytes[(k // pp) % vpp]
        peak = max(peak, live)
        if k >= warm:
            live -= chunk_bytes[vpp - 1 - (done // pp) % vpp]
            done += 1
    return peak


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Peak-memory model of the ranks of one configuration, linear in the layers a rank holds:
    per layer of each kind its static bytes (parameters, gradients, optimizer state after ZeRO
    sharding) and its activation bytes per micro-batch chunk in flight; per edge its static bytes
    and the loss's logits. Built once per configuration so the stage split can ask it cheaply."""

    model: ModelSpec
    cfg: ParallelConfig
    train: TrainSpec
    m: int
    static_dense: float
    static_moe: float
    act_dense: float
    act_moe: float
    static_embedding: float
    static_head: float
    logits: float
    fixed_buffers: float

    def _static_of(self, p: StageParams) -> tuple[float, float, float]:
        cfg, train = self.cfg, self.train
        w, g = train.weight_bytes, train.grad_bytes
        opt = (8 if train.optimizer == "adam" else 4) + (4 if w < 4 else 0)
        sharded = p.dense / (cfg.dp * cfg.cp) + p.expert / cfg.edp
        params = w * (sharded if cfg.zero == 3 else p.total)
        grads = g * (sharded if cfg.zero >= 2 else p.total)
        return params, grads, opt * (sharded if cfg.zero >= 1 else p.total)

    def chunk_need(self, rank: int, dense: int, moe: int, embedding: bool, head: bool) -> float:
        """Bytes a virtual chunk of ``dense`` + ``moe`` layers (and the edges named) adds to ``rank``:
        its static bytes and its share (1/vpp) of the rank's activations in flight."""
        flight = chunks_in_flight(self.cfg, self.m, rank) / self.cfg.vpp
        need = dense * (self.static_dense + flight * self.act_dense) + moe * (self.static_moe + flight * self.act_moe)
        if embedding:
            need += self.static_embedding
        if head:
            need += self.static_head + self.logits
        return need

    def breakdown(self, stage: StageLayers) -> MemoryBreakdown:
        """Peak bytes on one device of pipeline rank ``stage``."""
        cfg, model, train = self.cfg, self.model, self.train
        params, grads, opt = self._static_of(stage_params(model, cfg, stage))
        per_chunk = (stage.dense * self.act_dense + stage.moe * self.act_moe) / cfg.vpp
        acts = chunks_in_flight(cfg, self.m, stage.rank) * per_chunk
        if len(set(stage.chunks)) > 1:
            held = tuple(d * self.act_dense + e * self.act_moe for d, e in stage.chunks)
            acts = peak_in_flight(cfg.pp, cfg.vpp, self.m, stage.rank, held)
        if cfg.recompute == "full":
            kind = "moe" if stage.moe else "dense"
            acts += layer_activation_bytes(model, replace(cfg, recompute="none"), train, kind)  # the layer in backward
        if stage.head:
            acts += self.logits
        buffers = self.fixed_buffers
        if cfg.zero == 3:
            split = cfg.ep * cfg.etp_size
            widest = max(
                layer_params(model, cfg.tp, split, k).total
                for k, n in (("dense", stage.dense), ("moe", stage.moe))
                if n
            )
            buffers += 2 * widest * train.weight_bytes  # NOTE: current and prefetched layer, unsharded
        return MemoryBreakdown(params, grads, opt, acts, buffers, RUNTIME_RESERVE)

    def floor(self) -> float:
        """A lower bound of the largest rank's peak that needs no stage split: the mean over ranks
        of everything the ranks hold, each layer's activations counted at the smallest number of
        chunks any rank keeps in flight."""
        cfg, model = self.cfg, self.model
        least = min(chunks_in_flight(cfg, self.m, r) for r in range(cfg.pp)) / cfg.vpp
        layers = model.dense_layers * (self.static_dense + least * self.act_dense)
        layers += model.moe_layers * (self.static_moe + least * self.act_moe)
        edges = self.static_embedding + self.static_head + self.logits
        return (layers + edges) / cfg.pp + self.fixed_buffers + RUNTIME_RESERVE

    def fixed(self, rank: int, moe: bool) -> float:
        """Bytes of ``rank`` that do not scale with its layers: reserve, buffers, a fully recomputed
        layer's activations and, under FSDP, the gathered layers (an upper bound: the widest kind)."""
        cfg, model, train = self.cfg, self.model, self.train
        extra = RUNTIME_RESERVE + self.fixed_buffers
        if cfg.recompute == "full":
            extra += layer_activation_bytes(model, replace(cfg, recompute="none"), train, "moe" if moe else "dense")
        if cfg.zero == 3:
            split = cfg.ep * cfg.etp_size
            kinds = ("dense", "moe") if model.moe_layers else ("dense",)
            extra += 2 * max(layer_params(model, cfg.tp, split, k).total for k in kinds) * train.weight_bytes
        return extra


@functools.lru_cache(maxsize=4096)
def stage_memory(model: ModelSpec, cfg: ParallelConfig, train: TrainSpec) -> StageMemory:
    """The ``StageMemory`` of ``cfg`` (cached)."""
    a, g = train.act_bytes, train.grad_bytes
    split = cfg.ep * cfg.etp_size
    probe = StageMemory(model, cfg, train, cfg.num_microbatches(train), 0, 0, 0, 0, 0, 0, 0, 0)

    def static(p: StageParams) -> float:
        return sum(probe._static_of(p))

    T = cfg.micro_batch_size * train.seq_len / cfg.cp
    Tsp = T / cfg.tp if cfg.sp else T
    buffers = 0.0
    if cfg.tp > 1:
        buffers += 2 * T * model.hidden * a
    if cfg.pp > 1:
        buffers += 2 * Tsp * model.hidden * a
    if cfg.ep > 1 or cfg.etp_size > 1:
        buffers += 2 * Tsp * model.top_k * model.routing_imbalance * cfg.etp_size * model.hidden * a
    if cfg.cp > 1:
        kv = T * model.n_kv_heads / cfg.tp * (model.qk_head_dim + model.v_dim) * a
        # NOTE: ring methods hold the block in use and the one arriving; all-gather CP the keys and
        # values of the whole sequence, and in the backward their gradients before the reduce-scatter
        buffers += 2 * kv * (cfg.cp if cfg.cp_method == "allgather" else 1)
    if cfg.zero >= 2:
        buffers += max(BUCKET_MIN, 1e6 * cfg.dp) * g
    moe = model.moe_layers > 0
    return replace(
        probe,
        static_dense=static(layer_params(model, cfg.tp, split, "dense")),
        static_moe=static(layer_params(model, cfg.tp, split, "moe")) if moe else 0.0,
        act_dense=layer_activation_bytes(model, cfg, train, "dense"),
        act_moe=layer_activation_bytes(model, cfg, train, "moe") if moe else 0.0,
        static_embedding=static(StageParams(edge_params(model, cfg.tp, cfg.pp, True, False), 0.0)),
        static_head=static(StageParams(edge_params(model, cfg.tp, cfg.pp, False, True), 0.0)),
        logits=T * model.vocab / cfg.tp * (a + 4),  # NOTE: logits + fp32 softmax of the loss
        fixed_buffers=buffers,
    )
