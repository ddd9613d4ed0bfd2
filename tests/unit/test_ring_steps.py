"""``ring-steps`` (``passes/cp/steps.py``): ring attention written as ``comm.ppermute`` and
``meshfold.ring_step`` ops. On whole tensors (the IR's global meaning, which
``parallelize(verify=True)`` checks every rank against) the steps compute what the kernel does; the
overlap pass runs each step while the next step's keys travel. No ranks here: the rank tests are the
ring cases of tests/dist/test_context_parallel.py and test_comm.py's ``ppermute``."""

from __future__ import annotations

import itertools
from functools import cache

import pytest
import torch

from meshfold import DEFAULT_PIPELINE, Options, capture, compile_model, ir
from meshfold.backends.interpret import interpret, run_values
from meshfold.ir.dialects.ring import (
    LSE_MERGE,
    RING_STEP,
    inverse,
    lse_merge,
    permuted,
    ring_step,
    ring_step_backward,
    shift_order,
    summed,
    zigzag_order,
)
from meshfold.ir.ops import PPERMUTE, WAIT
from meshfold.tools.zoo import build

aten = torch.ops.aten


@pytest.mark.parametrize(
    ("n", "causal", "kv"), [(2, True, 4), (4, True, 2), (3, True, 4), (4, False, 4), (2, False, 1)]
)
def test_the_steps_of_a_ring_add_up_to_attention(n: int, causal: bool, kv: int) -> None:
    """Whole tensors through the steps as the pass writes them (zigzag split when causal, ``n`` steps with
    the keys shifted between them, merged by log-sum-exp; backward: the passed keys' gradients shifted
    on with them and home after the last step) equal the flash kernel and its backward, grouped-query
    keys included."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 48, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, kv, 48, 8, dtype=torch.float64, generator=g) for _ in range(2))
    grad = torch.randn(2, 4, 48, 8, dtype=torch.float64, generator=g)
    whole = [x.repeat_interleave(4 // kv, 1) for x in (k, v)]
    out, lse, *_ = aten._scaled_dot_product_flash_attention_for_cpu(q, *whole, 0.0, causal)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, *whole, out, lse, 0.0, causal)

    def split(x: torch.Tensor) -> torch.Tensor:
        return permuted(x, 2, zigzag_order(n)) if causal else x

    def back(x: torch.Tensor) -> torch.Tensor:
        return permuted(x, 2, inverse(zigzag_order(n))) if causal else x

    def shift(x: torch.Tensor) -> torch.Tensor:
        return permuted(x, 2, shift_order(n))

    qz, kz, vz, gz = split(q), split(k), split(v), split(grad)
    o, lo = ring_step(qz, kz, vz, -1, n, 0, causal, causal)
    ks, vs = kz, vz
    for s in range(1, n):
        ks, vs = shift(ks), shift(vs)
        o, lo = lse_merge(o, lo, *ring_step(qz, ks, vs, -1, n, s, causal, causal))
    torch.testing.assert_close(back(o), out)
    torch.testing.assert_close(back(lo), lse)
    gq, gk, gv = ring_step_backward(gz, qz, kz, vz, o, lo, -1, n, 0, causal, causal)
    ks, vs, ak, av = kz, vz, None, None
    for s in range(1, n):
        ks, vs = shift(ks), shift(vs)
        sq, sk, sv = ring_step_backward(gz, qz, ks, vs, o, lo, -1, n, s, causal, causal)
        gq = gq + sq
        ak, av = (sk, sv) if ak is None or av is None else (sk + shift(ak), sv + shift(av))
    assert ak is not None and av is not None
    gk, gv = gk + shift(ak), gv + shift(av)
    torch.testing.assert_close(back(gq), dq)
    torch.testing.assert_close(back(gk), summed(dk, 4 // kv))
    torch.testing.assert_close(back(gv), summed(dv, 4 // kv))


@cache
def _llama() -> tuple[torch.nn.Module, torch.Tensor, ir.Graph]:
    """llama-tiny (4 query heads over 2 of keys and values, the kernel called causal, no mask tensor) on
    one sequence of 32 tokens."""
    net, _ = build("llama-tiny")
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    return net, ids, capture(net, (ids, ids.clone()))


@cache
def _compiled(n: int, steps: bool, method: str = "ring") -> ir.Graph:
    pipeline = DEFAULT_PIPELINE if steps else DEFAULT_PIPELINE.replace("ring-steps,", "")
    options = Options.of(mesh=f"cp={n}", plan="cp", cp={"method": method}, pipeline=pipeline)
    return compile_model(_llama()[2], None, options).graph


@pytest.mark.parametrize("method", ["ring", "tokenring"])
@pytest.mark.parametrize("n", [2, 4])
def test_ring_steps_compute_every_value_the_kernel_does_on_whole_tensors(n: int, method: str) -> None:
    """The compiled program with the steps (ring attention's, or TokenRing's: the queries travel and
    the results come back), run on whole tensors, gives the loss and every gradient of the one-device
    capture, and every value it shares with the program that keeps the kernel whole."""
    net, ids, captured = _llama()
    feeds = {k: v.detach() for k, v in [*net.named_parameters(), *net.named_buffers()]}
    feeds |= {i.name: ids for i in captured.inputs if i.kind == "input"}
    steps, kernel = _compiled(n, True, method), _compiled(n, False, method)
    shifts = {op.kwarg("order") for op in steps.ops if op.target == PPERMUTE}
    # NOTE: ring attention's keys (TokenRing's queries) go one rank on at a time; TokenRing's results
    # come straight back from the rank s on
    back = {shift_order(n, -s) for s in range(1, n)} if method == "tokenring" else set()
    assert {shift_order(n), *back} <= shifts
    assert any(op.target == RING_STEP for op in steps.ops) and not any(op.target == RING_STEP for op in kernel.ops)
    want = interpret(captured, feeds)
    got = run_values(steps, feeds, global_view=True)
    for o in steps.outputs:
        torch.testing.assert_close(got[o.value], want[(o.kind, o.name)], msg=f"{o.kind} {o.name}")
    whole = {v.name: (v.type, x) for v, x in run_values(kernel, feeds, global_view=True).items()}
    # NOTE: values outside the rings keep their names (the kernel's results too: the last step writes them)
    shared = [(v, x) for v, x in got.items() if v.name in whole and whole[v.name][0] == v.type]
    assert len(shared) > len(whole) // 2, (len(shared), len(whole))
    for v, x in shared:
        torch.testing.assert_close(x, whole[v.name][1], msg=v.name)


def test_overlap_runs_each_step_while_the_next_keys_travel() -> None:
    """In the scheduled program each forward step ``s >= 1`` reads keys and values whose
    ``comm.ppermute`` started before step ``s - 1`` computes and is waited after it."""
    graph = _compiled(4, True)
    at = {op: i for i, op in enumerate(graph.ops)}
    producers = graph.producers()
    fwd = [op for op in graph.ops if op.target == RING_STEP and op.prov.phase == "fwd"]
    assert len(fwd) == 2 * 4  # NOTE: two layers, four steps each
    rings = [fwd[i : i + 4] for i in range(0, len(fwd), 4)]
    for ring in rings:
        assert [op.args[5] for op in ring] == [0, 1, 2, 3]
        for before, step in itertools.pairwise(ring):
            for held in step.operands[1:3]:
                wait = producers[held]
                assert wait.target == WAIT
                start = producers[wait.operands[0]]
                assert start.target == PPERMUTE and start.kwarg("order") == shift_order(4)
                assert at[start] < at[before] < at[wait] < at[step], (start.name, before.name, wait.name)
    merges = [op for op in graph.ops if op.target == LSE_MERGE]
    assert len(merges) == 2 * 3


def test_ring_steps_hold_no_more_than_the_kernel() -> None:
    """The predicted peak of one rank (``rank_memory``) with the steps is the kernel's: the overlap pass
    passes each block on while the step before it computes (two blocks held, not the ring) and moves
    the backward's saved values to the zigzag split where their first step needs them, not a layer
    ahead. The bench's Llama-style model on one sequence of 1024 tokens, cp=2 (without the second
    rule the steps hold 1 MiB more at the backward's start)."""
    from meshfold.passes.cost.liveness import rank_memory
    from meshfold.tools.bench.eager_vs_dtensor import Config
    from meshfold.tools.bench.eager_vs_dtensor import build as build_llama

    model, inputs = build_llama(Config(hidden=64, layers=2, heads=4, kv_heads=2, batch=1, seq=1024))
    peaks = []
    for pipeline in (DEFAULT_PIPELINE, DEFAULT_PIPELINE.replace("ring-steps,", "")):
        options = Options.of(mesh="cp=2", plan="cp", cp={"method": "ring"}, pipeline=pipeline)
        graph = compile_model(model, inputs, options).graph
        peaks.append(rank_memory(graph).peak)
        assert any(op.target == RING_STEP for op in graph.ops) == (pipeline == DEFAULT_PIPELINE)
    assert peaks[0] <= peaks[1], peaks
