"""Budgets of the ``memory`` pass (``passes.memory.budget``): per block keep, recompute or offload,
whichever adds least time, chosen by an integer program and checked against the liveness estimate."""

from __future__ import annotations

import itertools
import warnings
from dataclasses import replace

import pytest
import torch

from meshfold import ir
from meshfold.passes.cost.hardware import local_cluster
from meshfold.passes.cost.memory import rank_memory
from meshfold.passes.memory.budget import Choice, _cheapest, choices, decide
from meshfold.passes.memory.policies import Saved
from meshfold.session import CompileOptions, compile_model
from meshfold.tools.zoo import build
from tests.dist.cases import mlp_recomputed_attention_offloaded


@pytest.fixture(scope="module")
def boxed() -> ir.Graph:
    """llama-tiny on 32 x 64 tokens, FSDP + TP over (2, 2), up to boxing (what the memory pass sees)."""
    net, _ = build("llama-tiny")
    ids = torch.randint(0, 256, (32, 64), generator=torch.Generator().manual_seed(0))
    opts = CompileOptions.of(mesh="dp=2,tp=2", plan="fsdp+tp", pipeline="cleanup,moe-fold,sharding,boxing,bucket")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_model(net, (ids, ids), opts).graph


def _brute(options: list[Choice], need: int) -> float:
    """The least added time of at most one choice per block freeing ``need`` bytes, by enumeration."""
    per_block: dict[str, list[Choice | None]] = {}
    for c in options:
        per_block.setdefault(c.block, [None]).append(c)
    best = float("inf")
    for pick in itertools.product(*per_block.values()):
        taken = [c for c in pick if c is not None]
        if sum(c.freed for c in taken) >= need:
            best = min(best, sum(max(c.seconds, 1e-12) for c in taken))
    return best


def test_the_program_takes_the_least_time_that_frees_enough(boxed: ir.Graph) -> None:
    options = choices(boxed, None)
    assert {c.how for c in options} == {"pointwise", "full", "offload", "full+offload"}
    assert {c.block for c in options} == {"", "layers.0", "layers.1"}  # NOTE: "": the logits, the loss
    most = sum(max(c.freed for c in options if c.block == b) for b in {c.block for c in options})
    for share in (0.05, 0.3, 0.6, 0.95):
        need = int(share * most)
        picked = _cheapest(options, need)
        assert picked is not None
        assert len({c.block for c in picked}) == len(picked)
        assert sum(c.freed for c in picked) >= need
        assert sum(max(c.seconds, 1e-12) for c in picked) == pytest.approx(_brute(options, need), rel=1e-6)
    assert _cheapest(options, most + 1) is None


def test_prices_decide_between_recompute_and_offload(boxed: ir.Graph) -> None:
    """A slow host link makes the budget recompute; a fast one makes it offload; both meet it."""
    keep = rank_memory(boxed).peak
    budget = int(0.8 * keep)
    cpu = local_cluster(4)
    slow = replace(cpu, device=replace(cpu.device, host_bw=1e3))
    fast = replace(cpu, device=replace(cpu.device, host_bw=1e15))
    by_slow, by_fast = decide(boxed, budget, slow), decide(boxed, budget, fast)
    assert by_slow.recomputed and not by_slow.offloaded, by_slow.chosen
    assert by_fast.offloaded and not by_fast.recomputed, by_fast.chosen
    for d in (by_slow, by_fast):
        ir.verify(d.graph)
        assert rank_memory(d.graph).peak <= budget
    assert decide(boxed, keep, cpu).graph is boxed


def test_a_per_value_policy_decides_each_saved_activation() -> None:
    """``parallelize(memory=fn)``: what ``fn`` answers for each saved activation is done, and
    answers that cannot be done fail naming the value, its op and what to answer instead."""
    net, inputs = build("llama-tiny")
    seen: list[Saved] = []

    def every(saved: Saved) -> str:
        seen.append(saved)
        return mlp_recomputed_attention_offloaded(saved)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = compile_model(net, inputs, CompileOptions.of(mesh="dp=2,tp=2", plan="fsdp+tp", memory=every))
    stats = result.stats["memory"]
    assert isinstance(stats, dict) and stats["policy"].startswith("per value (")
    mlp = {s.name for s in seen if ".mlp" in s.module and s.recomputable}
    attention = {s.name for s in seen if ".self_attn" in s.module and s.name not in mlp}
    assert mlp and attention and all(s.nbytes >= 0 and s.op for s in seen)
    assert set(stats["recomputed"]) == mlp and set(stats["offloaded"]) <= attention and stats["offloaded"]
    names = {r.name for op in result.graph.ops for r in op.results}
    assert all(f"{v}_rc" in names for v in mlp) and all(f"{v}_host" in names for v in stats["offloaded"])
    assert stats["peak_after"] < stats["peak_before"]
    with pytest.raises(Exception, match=r"answered 'later' for %.* answer one of save, recompute, offload"):
        compile_model(net, inputs, CompileOptions.of(mesh="dp=2,tp=2", plan="fsdp+tp", memory=lambda s: "later"))
