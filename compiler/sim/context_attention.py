"""Time of one layer's attention core under context parallelism, by method
(``ParallelConfig.cp_method``), on one device of the ``cp`` group:

* ``ring`` (ring attention): the keys and values travel round the group; each of the ``cp`` steps
  computes one ``T x T`` block (``T`` local tokens) while the next step's keys and values are sent
  (point to point), so only what a send takes beyond its block shows. The load-balanced (zigzag)
  split makes every causal block half masked, like the diagonal one. The backward sends the key
  and value gradients along with them.
* ``tokenring`` (TokenRing's bidirectional ring): the queries travel one way and each block's
  output and log-sum-exp come back the other, at once over a full-duplex link, so a step sends the
  larger of the two; the keys and values (and their gradients) stay home. A last send brings the
  final blocks' results back (exposed). Backward: queries, output gradients and the softmax
  statistics out, query gradients back.
* ``ulysses`` (DeepSpeed-Ulysses): an all-to-all turns the sequence split into a split by heads
  (queries, keys and values before the kernel, the output after; backward: the output gradient
  before, the three input gradients after), blocking, and each device attends the whole sequence
  on ``1/cp`` of the heads. Key/value heads fewer than ``cp`` are repeated to ``cp``.
* ``allgather`` (Llama 3's context parallelism, "The Llama 3 Herd of Models" sec. 3.3.2): the keys
  and values of the whole sequence are all-gathered (blocking) and each device attends its own
  queries (two load-balanced chunks, so half the gathered context on average under the causal
  mask) in one kernel. Backward: the keys and values are gathered again (keeping them for every
  micro-batch in flight would cost ``cp`` times their memory) and their gradients reduce-scattered.
  Small under GQA, where the keys and values are a fraction of the queries.

Unfused attention (``flash`` False) materialises the scores over the whole gathered context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.passes.cost import comm, opcost

if TYPE_CHECKING:
    from meshfold.sim.layer import LayerBuilder
    from meshfold.sim.streams import Streams

METHODS = ("ring", "tokenring", "ulysses", "allgather")
LSE_BYTES = 4
"""One fp32 log-sum-exp (or softmax statistic) per query row and head."""


def attention_core(b: LayerBuilder, s: Streams, backward: bool) -> None:
    """Append one layer's attention core (forward or backward) to ``s``."""
    m, p = b.m, b.p
    heads = m.heads / p.tp
    kv_heads = heads if m.is_mla else m.n_kv_heads / p.tp
    ulysses = p.cp > 1 and p.cp_method == "ulysses"
    gathered = p.cp > 1 and p.cp_method == "allgather"
    tokens = b.T * p.cp if ulysses else b.T
    block = opcost.attention_time(
        b.dev,
        tokens,
        b.T * p.cp if gathered or not (b.flash or ulysses) else tokens,
        heads / p.cp if ulysses else heads,
        m.qk_head_dim,
        m.v_dim,
        causal=b.causal,
        backward=backward,
        dtype=b.attn_dtype,
        fused=b.flash,
    )
    if not b.flash or p.cp == 1:
        s.compute("flash attention" if b.flash else "attention", block)
        return
    qk, v, a = m.qk_head_dim, m.v_dim, b.a
    if gathered:
        kv = b.T * p.cp * kv_heads * (qk + v) * a
        s.blocking("cp all-gather keys, values", comm.collective_time("all_gather", b.c, p.cp_group, kv), "cp")
        s.compute("flash attention (gathered)", block)
        if backward:
            grads = comm.collective_time("reduce_scatter", b.c, p.cp_group, kv)
            s.blocking("cp reduce-scatter key, value gradients", grads, "cp")
        return
    if ulysses:
        kv = b.T * max(kv_heads, p.cp) * (qk + v) * a
        q, out = b.T * heads * qk * a, b.T * heads * v * a
        before, after = (out, q + kv) if backward else (q + kv, out)
        s.blocking("cp all-to-all to heads", comm.collective_time("all_to_all", b.c, p.cp_group, before), "cp")
        s.compute("flash attention (heads)", block)
        s.blocking("cp all-to-all to sequence", comm.collective_time("all_to_all", b.c, p.cp_group, after), "cp")
        return
    rows = b.T * heads
    if p.cp_method == "tokenring":
        there = rows * ((qk + v) * a + 2 * LSE_BYTES) if backward else rows * qk * a
        back = rows * qk * a if backward else rows * (v * a + LSE_BYTES)
        step = max(there, back)
    else:
        step = b.T * kv_heads * (qk + v) * a * (2 if backward else 1)
    send = comm.p2p(b.c, step, cross_node=p.cp_group.spans_nodes)
    s.compute(f"{p.cp_method} attention block 0", block)
    for i in range(1, p.cp):
        s.beside(f"cp send {i}", send, f"{p.cp_method} attention block {i}", block, "cp")
    if p.cp_method == "tokenring":
        s.blocking("cp results home", comm.p2p(b.c, back, cross_node=p.cp_group.spans_nodes), "cp")
