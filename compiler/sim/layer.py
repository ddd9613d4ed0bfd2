"""Time of one transformer layer for one micro-batch on one device (embedding and LM head: ``edges``).

A layer is laid out op by op on two streams, compute and comm. Tensor-parallel collectives are
*blocking* in the forward (the next GEMM needs their result) unless ``tp_comm_overlap`` pipelines
them with their GEMM in ``tp`` chunks (time ``max(G, C) + min(G, C) / tp``); in the backward the
input re-gather runs beside the data-gradient GEMM and the gradient reduce-scatter beside the
weight-gradient GEMM (Megatron's async TP). Context parallelism (ring attention, TokenRing or
Ulysses) is ``context``'s. Expert all-to-alls (over the ep group) and the expert
tensor-parallel all-gather / reduce-scatter (over etp) block; where the ep group sits -- inside a
node or strided over nodes -- follows from the expert mesh (``ParallelConfig.expert_axes``). Whatever
runs beside compute slows it by the device's ``contention``. Layers are costed once per kind and
cached.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, replace

from meshfold.passes.cost import comm, opcost
from meshfold.passes.cost.comm import Group
from meshfold.sim.context_attention import attention_core
from meshfold.sim.model import Matmul, ModelSpec
from meshfold.sim.streams import LayerCost, Streams, weight_grad_s
from meshfold.target.hardware import DTYPE_BYTES, Cluster

SOLO = comm.local_group(1)  # the group of a size-1 axis


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """The parts of a parallel configuration that shape one layer's work on one device."""

    tp: int
    cp: int
    sp: bool
    mbs: int
    recompute: str
    tp_overlap: bool
    ep: int
    etp: int
    tp_group: Group
    cp_group: Group
    ep_group: Group
    etp_group: Group
    cp_method: str = "ring"

    def dense_view(self) -> LayerPlan:
        """This plan with the expert fields reset: what a layer without experts (or a pipeline
        edge) depends on, so such layers are costed once per attention layout."""
        return replace(self, ep=1, etp=1, ep_group=SOLO, etp_group=SOLO)


class LayerBuilder:
    """Builds the forward and backward op sequences of one layer kind."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: Cluster,
        dtype: str,
        grad_dtype: str,
        causal: bool,
        flash: bool,
        seq: int,
        plan: LayerPlan,
    ) -> None:
        self.m, self.c, self.p = model, cluster, plan
        self.dev = cluster.device
        self.dtype = dtype
        # NOTE: fp8 recipes (Transformer Engine) run GEMMs in fp8 but attention in bf16.
        self.attn_dtype = "bf16" if dtype == "fp8" else dtype
        self.a = 2 if DTYPE_BYTES[dtype] <= 2 else 4  # activation bytes (fp8 GEMMs keep bf16 activations)
        self.g = DTYPE_BYTES[grad_dtype]
        self.causal, self.flash, self.seq = causal, flash, seq
        self.T = plan.mbs * seq / plan.cp  # tokens per device after context parallelism
        self.Tsp = self.T / plan.tp if plan.sp else self.T
        self.a2a_sent = 0.0  # bytes sent to other ranks in expert all-to-alls so far

    # --- primitives ----------------------------------------------------------------------------
    def gemm(self, mm: Matmul, tp: int, tokens: float) -> tuple[float, float, float]:
        """(forward, data-gradient, weight-gradient) seconds of ``mm`` split over ``tp``."""
        k = mm.k / tp if mm.split == "row" else mm.k
        n = mm.n / tp if mm.split == "col" else mm.n
        d = self.dtype
        fwd = opcost.gemm_time(self.dev, tokens, n, k, d)
        dgrad = opcost.gemm_time(self.dev, tokens, k, n, d)
        wgrad = opcost.gemm_time(self.dev, k, n, tokens, d, extra_bytes=2 * k * n * self.g)
        return fwd, dgrad, wgrad

    def eltwise(self, elems: float) -> float:
        """Seconds for one memory-bound kernel touching ``elems`` activation elements."""
        return opcost.memory_time(self.dev, elems * self.a)

    def tp_coll(self, kind: str) -> float:
        """Seconds for one ``kind`` collective of the full activation over the tp group."""
        return comm.collective_time(kind, self.c, self.p.tp_group, self.T * self.m.hidden * self.a)

    # --- attention block ------------------------------------------------------------------------
    def _attn_core(self, s: Streams, backward: bool) -> None:
        attention_core(self, s, backward)

    def attention_fwd(self, s: Streams) -> None:
        """Norm, (gathered) projections, rope, attention core, output projection, residual."""
        m, p = self.m, self.p
        h = m.hidden
        s.compute("norm1", self.eltwise(2 * self.Tsp * h))
        mms = m.attention_matmuls()
        first = True
        for mm in mms:
            if mm.split == "row":
                continue
            fwd = self.gemm(mm, p.tp, self.T)[0]
            if first and p.sp:
                if p.tp_overlap:
                    s.pipelined("tp all-gather", self.tp_coll("all_gather"), mm.name, fwd, p.tp, True, "tp")
                else:
                    s.blocking("tp all-gather", self.tp_coll("all_gather"), "tp")
                    s.compute(mm.name, fwd)
            else:
                s.compute(mm.name, fwd)
            first = False
        q_k = self.T * (m.heads + (0 if m.is_mla else m.n_kv_heads)) * m.qk_head_dim / p.tp
        s.compute("rope", self.eltwise(2 * q_k))
        self._attn_core(s, backward=False)
        self._row_out(s, next(mm for mm in mms if mm.split == "row"), p.tp)
        s.compute("residual add", self.eltwise(3 * self.Tsp * h))

    def _row_out(self, s: Streams, mm: Matmul, tp: int) -> None:
        fwd = self.gemm(mm, tp, self.T)[0]
        if tp == 1:
            s.compute(mm.name, fwd)
        elif self.p.sp:
            if self.p.tp_overlap:
                s.pipelined("tp reduce-scatter", self.tp_coll("reduce_scatter"), mm.name, fwd, tp, False, "tp")
            else:
                s.compute(mm.name, fwd)
                s.blocking("tp reduce-scatter", self.tp_coll("reduce_scatter"), "tp")
        else:
            s.compute(mm.name, fwd)
            s.blocking("tp all-reduce", self.tp_coll("all_reduce"), "tp")

    def col_bwd(self, s: Streams, mms: list[Matmul], tp: int, tokens: float, last: bool) -> None:
        """Backward of column/replicated matmuls fed by one gathered input; ``last`` ones carry the
        input re-gather (beside dgrad) and the input-gradient reduction (beside wgrad)."""
        for mm in reversed(mms):
            _, dgrad, wgrad = self.gemm(mm, tp, tokens)
            if last and mm is mms[0] and tp > 1:
                if self.p.sp:
                    s.beside("tp all-gather (input)", self.tp_coll("all_gather"), mm.name + " dgrad", dgrad, "tp")
                    s.beside(
                        "tp reduce-scatter (grad)", self.tp_coll("reduce_scatter"), mm.name + " wgrad", wgrad, "tp"
                    )
                else:
                    s.compute(mm.name + " dgrad", dgrad)
                    s.beside("tp all-reduce (grad)", self.tp_coll("all_reduce"), mm.name + " wgrad", wgrad, "tp")
            else:
                s.compute(mm.name + " dgrad", dgrad)
                s.compute(mm.name + " wgrad", wgrad)

    def _row_bwd(self, s: Streams, mm: Matmul, tp: int) -> None:
        _, dgrad, wgrad = self.gemm(mm, tp, self.T)
        if tp > 1 and self.p.sp:
            if self.p.tp_overlap:
                s.pipelined(
                    "tp all-gather (grad)", self.tp_coll("all_gather"), mm.name + " dgrad", dgrad, tp, True, "tp"
                )
            else:
                s.blocking("tp all-gather (grad)", self.tp_coll("all_gather"), "tp")
                s.compute(mm.name + " dgrad", dgrad)
        else:
            s.compute(mm.name + " dgrad", dgrad)
        s.compute(mm.name + " wgrad", wgrad)

    def attention_bwd(self, s: Streams) -> None:
        """The attention block backward, in reverse op order."""
        m, p = self.m, self.p
        h = m.hidden
        mms = m.attention_matmuls()
        s.compute("residual add bwd", self.eltwise(2 * self.Tsp * h))
        self._row_bwd(s, next(mm for mm in mms if mm.split == "row"), p.tp)
        self._attn_core(s, backward=True)
        q_k = self.T * (m.heads + (0 if m.is_mla else m.n_kv_heads)) * m.qk_head_dim / p.tp
        s.compute("rope bwd", self.eltwise(2 * q_k))
        self.col_bwd(s, [mm for mm in mms if mm.split != "row"], p.tp, self.T, True)
        s.compute("norm1 bwd", self.eltwise(3 * self.Tsp * h))

    # --- MLP / MoE -----------------------------------------------------------------------------
    def _act_elems(self, width: float, tokens: float, backward: bool) -> float:
        if self.m.gated_mlp:
            return tokens * width * (5 if backward else 3)
        return tokens * width * (3 if backward else 2)

    def mlp_fwd(self, s: Streams, width: int, tag: str = "") -> None:
        """Column-parallel up projection, activation, row-parallel down projection."""
        p = self.p
        fc1, fc2 = self.m.mlp_matmuls(width)
        fwd1 = self.gemm(fc1, p.tp, self.T)[0]
        if p.sp and p.tp_overlap:
            s.pipelined("tp all-gather", self.tp_coll("all_gather"), tag + "fc1", fwd1, p.tp, True, "tp")
        else:
            if p.sp:
                s.blocking("tp all-gather", self.tp_coll("all_gather"), "tp")
            s.compute(tag + "fc1", fwd1)
        s.compute(tag + "activation", self.eltwise(self._act_elems(width / p.tp, self.T, False)))
        self._row_out(s, fc2, p.tp)

    def mlp_bwd(self, s: Streams, width: int, tag: str = "") -> None:
        """The MLP backward, in reverse op order."""
        p = self.p
        fc1, fc2 = self.m.mlp_matmuls(width)
        self._row_bwd(s, fc2, p.tp)
        s.compute(tag + "activation bwd", self.eltwise(self._act_elems(width / p.tp, self.T, True)))
        self.col_bwd(s, [fc1], p.tp, self.T, True)

    def _routed_tokens(self, etp: int | None = None) -> float:
        """Token copies the busiest expert rank computes (after the expert-TP all-gather over
        ``etp``, the plan's by default)."""
        m = self.m
        return self.Tsp * m.top_k * m.routing_imbalance * (self.p.etp if etp is None else etp)

    def expert_gemms(self, ep: int, etp: int) -> tuple[float, float]:
        """Forward seconds of the busiest rank's grouped expert GEMMs (fc1, fc2) under ``ep`` x ``etp``."""
        m = self.m
        h, rows, local = m.hidden, self._routed_tokens(etp), m.num_experts // ep
        fc1, fc2 = m.mlp_matmuls(m.moe_ffn_hidden)
        g1 = opcost.grouped_gemm_time(self.dev, local, rows / local, fc1.n / etp, h, self.dtype)
        g2 = opcost.grouped_gemm_time(self.dev, local, rows / local, h, fc2.k / etp, self.dtype)
        return g1, g2

    def a2a_buffer(self) -> float:
        """Bytes one expert all-to-all moves per rank (its own share included): the busiest rank's
        ``tokens x top_k x routing_imbalance`` token copies of ``hidden`` activations."""
        m = self.m
        return self.Tsp * m.top_k * m.routing_imbalance * m.hidden * self.a

    def moe(self, s: Streams, backward: bool) -> None:
        """Router, dispatch all-to-all over ep (+ all-gather over etp), grouped expert GEMMs,
        and the mirror-image combine; the backward runs the same steps in reverse order. Adds the
        bytes the all-to-alls send to other ranks to ``a2a_sent``."""
        m, p = self.m, self.p
        h, rows = m.hidden, self._routed_tokens()
        fc2 = m.mlp_matmuls(m.moe_ffn_hidden)[1]
        mult = 2 if backward else 1  # data- and weight-gradient GEMMs
        g1, g2 = (mult * g for g in self.expert_gemms(p.ep, p.etp))
        buffer = self.a2a_buffer()
        a2a = comm.all_to_all(self.c, p.ep_group, buffer)
        sent = buffer * (p.ep - 1) / p.ep if a2a > 0 else 0.0
        etp_bytes = rows * h * self.a
        ag = comm.all_gather(self.c, p.etp_group, etp_bytes) if p.etp > 1 else 0.0
        rs = comm.reduce_scatter(self.c, p.etp_group, etp_bytes) if p.etp > 1 else 0.0
        router = opcost.gemm_time(self.dev, self.Tsp, m.num_experts, h, self.dtype) + self.eltwise(
            3 * self.Tsp * m.num_experts
        )
        act = self.eltwise(self._act_elems(fc2.k / p.etp, rows, backward))
        permute = self.eltwise(2 * self.Tsp * m.top_k * h)
        # NOTE: (stream or collective category, forward name, backward name, seconds, bytes sent in
        # an all-to-all); the backward walks the table in reverse.
        steps = (
            ("compute", "router", "router bwd", 2 * router if backward else router, 0.0),
            ("compute", "permute", "permute bwd", permute, 0.0),
            ("ep", "ep all-to-all (dispatch)", "ep all-to-all (dispatch bwd)", a2a, sent),
            ("etp", "etp all-gather", "etp reduce-scatter (grad)", ag, 0.0),
            ("compute", "experts fc1", "experts fc1 bwd", g1, 0.0),
            ("compute", "experts activation", "experts activation bwd", act, 0.0),
            ("compute", "experts fc2", "experts fc2 bwd", g2, 0.0),
            ("etp", "etp reduce-scatter", "etp all-gather (grad)", rs, 0.0),
            ("ep", "ep all-to-all (combine)", "ep all-to-all (combine bwd)", a2a, sent),
            ("compute", "unpermute", "unpermute bwd", permute, 0.0),
        )
        for stream, fwd_name, bwd_name, dur, nbytes in reversed(steps) if backward else steps:
            name = bwd_name if backward else fwd_name
            if stream == "compute":
                s.compute(name, dur)
            else:
                s.blocking(name, dur, stream)
            self.a2a_sent += nbytes

    # --- whole layer ---------------------------------------------------------------------------
    def forward(self, s: Streams, kind: str) -> None:
        """Lay out one whole layer of ``kind`` ("dense" / "moe") forward on ``s``."""
        m = self.m
        self.attention_fwd(s)
        s.compute("norm2", self.eltwise(2 * self.Tsp * m.hidden))
        if kind == "moe":
            if m.shared_experts:
                self.mlp_fwd(s, m.moe_ffn_hidden * m.shared_experts, "shared ")
            self.moe(s, backward=False)
        else:
            self.mlp_fwd(s, m.ffn_hidden)
        s.compute("residual add", self.eltwise(3 * self.Tsp * m.hidden))

    def backward(self, s: Streams, kind: str) -> None:
        """Lay out one whole layer of ``kind`` backward on ``s``."""
        m = self.m
        s.compute("residual add bwd", self.eltwise(2 * self.Tsp * m.hidden))
        if kind == "moe":
            self.moe(s, backward=True)
            if m.shared_experts:
                self.mlp_bwd(s, m.moe_ffn_hidden * m.shared_experts, "shared ")
        else:
            self.mlp_bwd(s, m.ffn_hidden)
        s.compute("norm2 bwd", self.eltwise(3 * self.Tsp * m.hidden))
        self.attention_bwd(s)

    def selective_recompute(self, s: Streams, kind: str) -> None:
        """Re-run the norms and the MLP activation (and unfused attention) before the backward."""
        m, p = self.m, self.p
        width = m.ffn_hidden if kind == "dense" else m.moe_ffn_hidden * m.shared_experts
        s.compute("recompute norms", 2 * self.eltwise(2 * self.Tsp * m.hidden))
        s.compute("recompute activation", self.eltwise(self._act_elems(width / p.tp, self.T, False)))
        if not self.flash:
            self._attn_core(s, backward=False)


def layer_cost(
    model: ModelSpec,
    cluster: Cluster,
    dtype: str,
    grad_dtype: str,
    causal: bool,
    flash: bool,
    seq: int,
    plan: LayerPlan,
    kind: str,
) -> LayerCost:
    """Forward and backward seconds of one ``kind`` ("dense" or "moe") layer for one micro-batch."""
    if kind == "dense":
        plan = plan.dense_view()
    return _layer_cost(model, cluster, dtype, grad_dtype, causal, flash, seq, plan, kind)


@functools.lru_cache(maxsize=16384)
def _layer_cost(
    model: ModelSpec,
    cluster: Cluster,
    dtype: str,
    grad_dtype: str,
    causal: bool,
    flash: bool,
    seq: int,
    plan: LayerPlan,
    kind: str,
) -> LayerCost:
    """``layer_cost`` on a plan that holds only what ``kind`` depends on (cached)."""
    lay = LayerBuilder(model, cluster, dtype, grad_dtype, causal, flash, seq, plan)
    contention = cluster.device.eff.contention
    f = Streams(contention, "fwd")
    lay.forward(f, kind)
    b = Streams(contention, "bwd")
    if plan.recompute == "full":
        b.category = "recompute"
        lay.forward(b, kind)
        b.category = "bwd"
    elif plan.recompute == "selective":
        b.category = "recompute"
        lay.selective_recompute(b, kind)
        b.category = "bwd"
    recompute = b.now
    lay.backward(b, kind)
    a2a_exposed = f.exposed_by.get("ep", 0.0) + b.exposed_by.get("ep", 0.0)
    return LayerCost(
        f.now,
        b.now,
        f.exposed,
        b.exposed,
        f.comm_busy + b.comm_busy,
        recompute,
        tuple(f.events),
        tuple(b.events),
        a2a_exposed,
        lay.a2a_sent,
        weight_grad_s(b.events),
    )


def expert_floor(
    model: ModelSpec,
    cluster: Cluster,
    dtype: str,
    grad_dtype: str,
    causal: bool,
    flash: bool,
    seq: int,
    plan: LayerPlan,
    layouts: Iterable[tuple[int, int]],
) -> tuple[float, float]:
    """Lower bounds of a MoE layer's forward and backward seconds under ``plan`` with any expert
    layout of ``layouts`` ((ep, etp) pairs), from one costing: the layer with ep = etp = 1 has no
    expert collectives (the others only add time), and its grouped GEMMs are cut to the fastest
    layout's. A pass is 1-Lipschitz in each compute op (``Streams``), so cutting a GEMM by ``d``
    saves at most ``d``; the rest of the expert block (router, permutes, activation) is the same
    under every layout."""
    solo = plan.dense_view()
    one = _layer_cost(model, cluster, dtype, grad_dtype, causal, flash, seq, solo, "moe")
    lay = LayerBuilder(model, cluster, dtype, grad_dtype, causal, flash, seq, solo)
    cut = max(0.0, sum(lay.expert_gemms(1, 1)) - min(sum(lay.expert_gemms(ep, etp)) for ep, etp in layouts))
    # NOTE: the backward runs the data- and weight-gradient GEMMs, and full recomputation the forward's again
    passes = 3 if plan.recompute == "full" else 2
    return one.fwd_s - cut, one.bwd_s - passes * cut
