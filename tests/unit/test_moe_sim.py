"""MoE in the cost model: folded / unfolded expert meshes (Megatron-Core MoE parallel folding),
their constraints, all-to-all placement and volume, routing imbalance, expert optimizer sharding
over the expert data-parallel group, and the search over ep / etp / mapping."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshfold.sim import (
    ConfigError,
    ModelSpec,
    ParallelConfig,
    TrainSpec,
    candidates,
    gpt,
    parse_cluster,
    preset,
    search_configs,
    simulate,
)
from meshfold.sim.simulate import layer_plan

# NOTE: hand-countable: MHA 4 heads of 16, 4 SwiGLU experts of width 32, top-2, untied embeddings.
TINY = ModelSpec("tiny", 2, 64, 4, 128, 256, num_experts=4, top_k=2, moe_ffn_hidden=32)
NODE = parse_cluster("h100:8x1")
TINY_TRAIN = TrainSpec(64, 8)
MIX = preset("mixtral-8x7b")
C64 = parse_cluster("h100:8x8")


@pytest.mark.parametrize(
    ("model", "cfg", "match"),
    [
        (TINY, ParallelConfig(dp=8, ep=8), r"num_experts % ep == 0 violated"),
        (replace(TINY, moe_ffn_hidden=36), ParallelConfig(dp=8, ep=1, etp=8), r"moe_ffn_hidden % etp == 0 violated"),
        (TINY, ParallelConfig(dp=2, tp=2, pp=2, ep=4, etp=2), r"etp\*ep\*edp\*pp == world violated"),
        (TINY, ParallelConfig(dp=4, tp=2, ep=4, etp=1, moe_mapping="unfolded"), r"etp == tp violated"),
        (TINY, ParallelConfig(dp=2, cp=4, ep=4, moe_mapping="unfolded"), r"dp % ep == 0 violated"),
        (
            TINY,
            ParallelConfig(dp=8, ep=4, moe_mapping="unfolded", order="tp-ep-cp-pp-dp"),
            r"ep next to dp in order violated",
        ),
        (TINY, ParallelConfig(dp=8, ep=4, moe_mapping="sideways"), r"moe_mapping 'sideways' must be one of"),
        (TINY, ParallelConfig(dp=4, tp=2, ep=4, sequence_parallel=False), r"requires sequence_parallel"),
        (gpt("dense", 2, 64, 4), ParallelConfig(dp=4, ep=2, tp=2), r"ep=2 needs a model with experts"),
    ],
)
def test_expert_constraints_are_named(model: ModelSpec, cfg: ParallelConfig, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        cfg.validate(model, NODE, TINY_TRAIN)


def test_folded_mapping_allows_what_unfolded_forbids() -> None:
    # ep spans the attention tp ranks and ETP differs from TP: folded only.
    folded = ParallelConfig(dp=4, tp=2, ep=4, etp=1)
    folded.validate(TINY, NODE, TINY_TRAIN)
    assert folded.edp == 2 and folded.expert_axes() == (("etp", 1), ("ep", 4), ("edp", 2), ("pp", 1))
    # ep larger than dp: folded only (the classic layout nests ep inside dp).
    wide = ParallelConfig(dp=2, cp=4, ep=4)
    wide.validate(TINY, NODE, TINY_TRAIN)
    with pytest.raises(ConfigError, match=r"dp % ep"):
        replace(wide, moe_mapping="unfolded").validate(TINY, NODE, TINY_TRAIN)
    # unfolded: ep splits dp, cp stays its own part of edp = cp * dp / ep.
    classic = ParallelConfig(dp=4, cp=2, ep=2, moe_mapping="unfolded")
    classic.validate(TINY, NODE, TINY_TRAIN)
    assert classic.edp == 4 and classic.edp_axes() == ("cp", "edp")
    assert classic.expert_axes() == (("etp", 1), ("cp", 2), ("ep", 2), ("edp", 2), ("pp", 1))
    assert "unfolded" in classic.describe() and "unfolded" not in folded.describe()


def test_folding_ep_into_a_node_cuts_exposed_all_to_all() -> None:
    train = TrainSpec(4096, 64)
    inside = ParallelConfig(dp=8, tp=8, ep=8, etp=1)  # ep on the ranks attention uses for tp
    across = replace(inside, order="tp-cp-dp-ep-pp")  # same sizes, ep strided over the nodes
    unfolded = ParallelConfig(dp=8, tp=8, ep=8, moe_mapping="unfolded")  # classic: etp = tp = 8
    assert layer_plan(C64, inside).ep_group.nodes == 1
    assert layer_plan(C64, across).ep_group.nodes == 8 and layer_plan(C64, unfolded).ep_group.nodes == 8
    a, b, u = (simulate(MIX, C64, c, train, timeline=False) for c in (inside, across, unfolded))
    assert a.a2a_bytes == b.a2a_bytes == u.a2a_bytes > 0  # same volume, different links
    assert a.a2a_exposed_s < b.a2a_exposed_s / 2
    assert a.a2a_exposed_s < u.a2a_exposed_s / 2
    in_layers = [dict(r.breakdown)["tp/cp/ep exposed"] for r in (a, b, u)]
    assert in_layers[0] < min(in_layers[1:])
    # The trade: whichever axis is innermost gets NVLink. With ep inside, the expert data-parallel
    # group strides over the nodes, so the expert-gradient reduction is the slower one.
    assert dict(a.breakdown)["dp exposed"] > dict(b.breakdown)["dp exposed"]


def test_routing_imbalance_slows_the_step() -> None:
    cfg, train = ParallelConfig(dp=16, tp=2, pp=2, ep=8, etp=1), TrainSpec(4096, 256)
    runs = [simulate(replace(MIX, routing_imbalance=r), C64, cfg, train, timeline=False) for r in (1.0, 1.25, 1.5)]
    steps = [r.step_time_s for r in runs]
    assert steps[0] < steps[1] < steps[2]
    assert runs[2].a2a_bytes == pytest.approx(1.5 * runs[0].a2a_bytes, rel=1e-12)
    assert runs[2].peak_memory_bytes > runs[0].peak_memory_bytes


def test_expert_optimizer_state_is_sharded_over_edp() -> None:
    # Dense parameters: 2 layers x (attention 16384 + norms 128 + router 256) + embedding 16384
    # + LM head 16384 + final norm 64 = 66368. Experts: 2 layers x 4 x 6144 = 49152, 12288 per
    # device with ep=4. Adam + fp32 master weights = 12 bytes per parameter.
    dense, experts = 66368, 49152 / 4
    zero1 = simulate(TINY, NODE, ParallelConfig(dp=8, ep=4, zero=1), TINY_TRAIN, timeline=False)
    assert zero1.config.edp == 2
    assert zero1.memory.optimizer == 12 * (dense / 8 + experts / 2)  # 173280 bytes
    replicated = simulate(TINY, NODE, ParallelConfig(dp=8, ep=4, zero=0), TINY_TRAIN, timeline=False)
    assert replicated.memory.optimizer == 12 * (dense + experts)  # 943872 bytes
    zero2 = simulate(TINY, NODE, ParallelConfig(dp=8, ep=4, zero=2), TINY_TRAIN, timeline=False)
    assert zero2.memory.grads == 4 * (dense / 8 + experts / 2)  # fp32 gradients, sharded alike
    assert zero1.memory.grads == 4 * (dense + experts)


def test_a2a_bytes_match_a_hand_count() -> None:
    # 64 tokens x top-2 x hidden 64 x 2 bytes = 16384 bytes per all-to-all, 3/4 of it to the
    # other ranks of ep=4; dispatch + combine, forward + backward = 4 per layer; 2 layers; one
    # micro-batch per step.
    base = simulate(TINY, NODE, ParallelConfig(dp=8, ep=4), TINY_TRAIN, timeline=False)
    assert base.a2a_bytes == 16384 * 3 / 4 * 4 * 2 == 98304
    full = simulate(TINY, NODE, ParallelConfig(dp=8, ep=4, recompute="full"), TINY_TRAIN, timeline=False)
    assert full.a2a_bytes == 16384 * 3 / 4 * 6 * 2  # the recomputed forward sends again
    staged = simulate(TINY, NODE, ParallelConfig(dp=4, pp=2, ep=4), TINY_TRAIN, timeline=False)
    assert staged.a2a_bytes == 16384 * 3 / 4 * 4 * 1 * 2  # one layer per stage, two micro-batches
    assert simulate(TINY, NODE, ParallelConfig(dp=8), TINY_TRAIN, timeline=False).a2a_bytes == 0.0


def test_search_covers_expert_parallelism_for_moe_only() -> None:
    cluster, train = parse_cluster("h100:8x2"), TrainSpec(4096, 64)
    found = search_configs(MIX, cluster, train, top=5)
    assert found and all(r.config.ep > 1 and r.result.fits for r in found)
    seen = list(candidates(MIX, cluster, train))
    assert {c.moe_mapping for c in seen} == {"folded", "unfolded"}
    assert {c.etp for c in seen} >= {1, 2, 4, 8} and {c.ep for c in seen} == {1, 2, 4, 8}
    unfolded = search_configs(MIX, cluster, train, fixed={"moe_mapping": "unfolded"}, top=3)
    assert unfolded and all(r.config.etp_size == r.config.tp and r.config.dp % r.config.ep == 0 for r in unfolded)
    dense = gpt("dense", 8, 1024, 16)
    assert all(c.ep == 1 for c in candidates(dense, cluster, train))
    assert all(r.config.ep == 1 for r in search_configs(dense, cluster, train, top=5))


def test_search_reports_progress_as_it_goes() -> None:
    seen: list[int] = []
    cluster = parse_cluster("h100:8x8")
    search_configs(preset("llama3-8b"), cluster, TrainSpec(seq_len=2048, global_batch=512), top=3, progress=seen.append)
    assert seen[0] == 0 and len(seen) > 2 and seen == sorted(seen), seen
