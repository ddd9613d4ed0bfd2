"""Time of the pipeline's edges for one micro-batch: token embedding (first stage) and final norm,
LM head and cross-entropy (last stage).

The vocabulary-parallel cross-entropy of Megatron-LM runs unfused in fp32 over the ``tokens x
vocab/tp`` logits; its traffic per logit is counted from its op sequence: forward = upcast (read
2 B, write 4 B), max (read 4), subtract (read 4, write 4), exp (read 4, write 4), sum (read 4),
normalise (read 4, write 4) = 42 B; backward = subtract one-hot (8), scale by the loss gradient
(8), downcast for the GEMM (read 4, write 2) = 22 B.
"""

from __future__ import annotations

import functools

from meshfold.passes.cost import comm, opcost
from meshfold.sim.layer import LayerBuilder, LayerPlan
from meshfold.sim.model import Matmul, ModelSpec
from meshfold.sim.streams import LayerCost, Streams, weight_grad_s
from meshfold.target.hardware import Cluster

CE_FWD_BYTES = 42.0
CE_BWD_BYTES = 22.0


@functools.lru_cache(maxsize=1024)
def head_cost(model: ModelSpec, cluster: Cluster, dtype: str, grad_dtype: str, seq: int, plan: LayerPlan) -> LayerCost:
    """Final norm + LM head GEMM + cross-entropy, forward and backward, for one micro-batch."""
    lay = LayerBuilder(model, cluster, dtype, grad_dtype, True, True, seq, plan)
    h, tp = model.hidden, plan.tp
    lm = Matmul("lm head", h, model.vocab, "col")
    logits = lay.T * model.vocab / tp
    loss_sync = comm.all_reduce(cluster, plan.tp_group, lay.T * 4) if tp > 1 else 0.0
    contention = cluster.device.eff.contention
    f = Streams(contention, "fwd")
    f.compute("final norm", lay.eltwise(2 * lay.Tsp * h))
    fwd, _, _ = lay.gemm(lm, tp, lay.T)
    if plan.sp and plan.tp_overlap:
        f.pipelined("tp all-gather", lay.tp_coll("all_gather"), "lm head", fwd, tp, True, "tp")
    else:
        if plan.sp:
            f.blocking("tp all-gather", lay.tp_coll("all_gather"), "tp")
        f.compute("lm head", fwd)
    f.compute("cross-entropy", opcost.memory_time(cluster.device, logits * CE_FWD_BYTES, kernels=6))
    for stat in ("max", "sum", "target"):
        f.blocking(f"tp all-reduce ({stat})", loss_sync, "tp")
    b = Streams(contention, "bwd")
    b.compute("cross-entropy bwd", opcost.memory_time(cluster.device, logits * CE_BWD_BYTES, kernels=3))
    lay.col_bwd(b, [lm], tp, lay.T, True)
    b.compute("final norm bwd", lay.eltwise(3 * lay.Tsp * h))
    return LayerCost(
        f.now,
        b.now,
        f.exposed,
        b.exposed,
        f.comm_busy + b.comm_busy,
        0.0,
        tuple(f.events),
        tuple(b.events),
        wgrad_s=weight_grad_s(b.events),
    )


@functools.lru_cache(maxsize=1024)
def embedding_cost(
    model: ModelSpec, cluster: Cluster, dtype: str, grad_dtype: str, seq: int, plan: LayerPlan
) -> LayerCost:
    """Vocabulary-parallel embedding lookup (its partial sums reduced over tp) and its backward
    scatter-add into the gradient buffer, for one micro-batch."""
    lay = LayerBuilder(model, cluster, dtype, grad_dtype, True, True, seq, plan)
    h, tp = model.hidden, plan.tp
    contention = cluster.device.eff.contention
    f = Streams(contention, "fwd")
    f.compute("embedding", lay.eltwise((2 + (1 if model.learned_positions else 0)) * lay.T * h))
    if tp > 1:
        f.blocking(
            "tp reduce-scatter" if plan.sp else "tp all-reduce",
            lay.tp_coll("reduce_scatter" if plan.sp else "all_reduce"),
            "tp",
        )
    b = Streams(contention, "bwd")
    if plan.sp:
        b.blocking("tp all-gather (grad)", lay.tp_coll("all_gather"), "tp")
    b.compute("embedding bwd", opcost.memory_time(cluster.device, lay.T * h * (lay.a + 2 * lay.g)))
    return LayerCost(
        f.now, b.now, f.exposed, b.exposed, f.comm_busy + b.comm_busy, 0.0, tuple(f.events), tuple(b.events)
    )
