"""Pipeline parallelism on gloo ranks: llama-style models trained by ``pm.step`` over a ``pp`` mesh axis
(with FSDP, DDP, tensor or expert parallelism on the other axis, or on ``pp`` alone), under each
schedule (GPipe, 1F1B, interleaved, zero bubble): the loss, every gradient a rank holds and the
parameters after AdamW steps equal the single-device model trained on the whole batch."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist.conftest import RankPools

Case = tuple[str, tuple[int, ...], tuple[str, ...], str, dict[str, Any], int]
PP4 = {"schedule": "1f1b", "microbatches": 4}
# NOTE: (model, mesh shape, axis names, plan, pp options, layers); 5 layers split unevenly over 2
# stages; HF Llama with its output layer tied to the token embedding, which both stages then hold;
# HF Mixtral's experts split over each stage's ranks (EP 2); the solve choosing the layouts on dp;
# (and the time model choosing the schedule); every block recomputed; the pp axis second; a label of
# every sequence ignored (equal counts per microbatch: the mean of the microbatches' mean losses is the batch's)
CASES: list[Case] = [
    ("llama", (2, 2), ("pp", "dp"), "pp+fsdp", {"schedule": "1f1b", "microbatches": 4}, 5),
    ("llama", (2, 2), ("pp", "tp"), "pp+tp", {"schedule": "1f1b", "microbatches": 4}, 4),
    ("llama", (2, 2), ("pp", "dp"), "pp+ddp", {"schedule": "gpipe", "microbatches": 2}, 4),
    ("llama", (4,), ("pp",), "pp", {"schedule": "interleaved", "microbatches": 4}, 8),
    ("llama", (2, 2), ("pp", "dp"), "pp+fsdp", {"schedule": "zero-bubble", "microbatches": 4}, 4),
    ("llama", (4,), ("pp",), "pp", {"schedule": "zero-bubble", "microbatches": 4, "virtual": 2}, 8),
    ("hf-llama-tied", (2, 2), ("pp", "dp"), "pp+fsdp", {"schedule": "1f1b", "microbatches": 4}, 4),
    ("hf-mixtral", (2, 2), ("pp", "dp"), "pp+fsdp", PP4, 4),
    ("llama", (2, 2), ("pp", "dp"), "pp+auto", {"microbatches": 4}, 4),
    ("llama-full", (2, 2), ("pp", "dp"), "pp+fsdp", PP4, 4),
    ("llama", (2, 2), ("dp", "pp"), "fsdp+pp", PP4, 4),
    ("llama-ignored", (2, 2), ("pp", "dp"), "pp+fsdp", PP4, 4),
]
MOE = {"hf-mixtral": {"ep": 2}}
"""The expert mapping of a case's model: HF Mixtral's experts split over the 2 ``dp`` ranks of each stage."""
MEMORY = {"llama-full": "full"}
"""The memory policy of a case: every block recomputed in the backward (the marks recomputed too)."""


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[f"{m}-{p}-{o.get('schedule', 'auto')}-{'x'.join(map(str, s))}-{n}layers" for m, s, _, p, o, n in CASES],
)
def test_pipelined_training_equals_single_device(rank_pools: RankPools, case: Case) -> None:
    model, shape, names, plan, pp, layers = case
    out = rank_pools.get(4).run(
        "tests.dist.cases_pipeline:pipelined_equivalence",
        shape=shape,
        names=names,
        plan=plan,
        pp=pp,
        layers=layers,
        model=model.removesuffix("-full").removesuffix("-ignored"),
        ignored=model.endswith("-ignored"),
        moe=MOE.get(model),
        memory=MEMORY.get(model),
    )
    schedule, virtual = out[0]["schedule"]
    assert all(r["schedule"] == out[0]["schedule"] for r in out)
    if "schedule" in pp:
        assert (schedule, virtual) == (pp["schedule"], pp.get("virtual", 2 if schedule == "interleaved" else 1))
    else:  # NOTE: chosen by the time model, the report says so and what else it weighed
        assert any("schedule chosen by the time model" in line and "gpipe" in line for line in out[0]["report"])
    stages = shape[names.index("pp")] * virtual
    # NOTE: every stage runs on some rank, and the ranks of one pp coordinate run the same ones
    assert sorted({s for r in out for s in r["stages"]}) == list(range(stages))
    assert all(r["losses"] == out[0]["losses"] for r in out)
    assert any(line.startswith("pipeline over 'pp'") for line in out[0]["report"])
    if model == "hf-llama-tied":
        assert all("model.embed_tokens.weight" in r["held"] for r in out)
    if model in MOE:  # NOTE: the experts run as one op, on the experts this rank holds
        assert all(any(t.startswith("meshfold.moe_experts") for t in r["ops"]) for r in out), out[0]["ops"]


def test_ignored_labels_falling_unevenly_on_the_microbatches_are_refused(rank_pools: RankPools) -> None:
    out = rank_pools.get(4).run("tests.dist.cases_pipeline:uneven_ignored_labels_refused")
    assert all(r == out[0] for r in out)
    assert "holds ignored labels (-100) unevenly over the 4 microbatches" in out[0][0]
    assert "counted labels per microbatch: [26, 32, 32, 32]" in out[0][0]
