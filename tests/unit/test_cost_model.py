"""Hardware catalog, model shapes and FLOPs, roofline kernel times and collective times."""

from __future__ import annotations

import math

import pytest

from meshfold.passes.cost.opcost import attention_time, flops_efficiency
from meshfold.sim import (
    Group,
    all_gather,
    all_reduce,
    all_to_all,
    device,
    from_hf_config,
    gemm_time,
    gpt,
    make_cluster,
    memory_time,
    p2p,
    parse_cluster,
    place_axes,
    preset,
    reduce_scatter,
)

LLAMA3_8B_HF = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
GPT2_HF = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
MIXTRAL_HF = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
DEEPSEEK_V3_HF = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "vocab_size": 129280,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


# --- models ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3-8b", 8.03e9),
        ("llama3-70b", 70.6e9),
        ("llama3-405b", 405.9e9),
        ("mixtral-8x7b", 46.7e9),
        ("mixtral-8x22b", 140.6e9),
        ("deepseek-v3", 671e9),
    ],
)
def test_parameter_counts_match_published(name: str, expected: float) -> None:
    assert preset(name).param_count() == pytest.approx(expected, rel=0.005)


def test_active_parameters_of_moe_models() -> None:
    assert preset("mixtral-8x7b").active_param_count() == pytest.approx(12.9e9, rel=0.01)
    assert preset("mixtral-8x22b").active_param_count() == pytest.approx(39.1e9, rel=0.01)
    assert preset("deepseek-v3").active_param_count() == pytest.approx(37e9, rel=0.03)
    assert preset("llama3-8b").active_param_count() == preset("llama3-8b").param_count()


def test_from_hf_config_accepts_llama_gpt2_mixtral_and_deepseek_keys() -> None:
    llama = from_hf_config(LLAMA3_8B_HF)
    assert llama.param_count() == preset("llama3-8b").param_count()
    assert llama.gated_mlp and not llama.tied_embeddings
    gpt2 = from_hf_config(GPT2_HF)
    assert not gpt2.gated_mlp and gpt2.tied_embeddings and gpt2.ffn_hidden == 4 * 768
    assert gpt2.param_count() == pytest.approx(124.44e6, rel=0.001)
    assert from_hf_config(MIXTRAL_HF).param_count() == preset("mixtral-8x7b").param_count()
    ds = from_hf_config(DEEPSEEK_V3_HF)
    assert ds.is_mla and ds.first_k_dense == 3
    assert ds.param_count() == pytest.approx(671e9, rel=0.005)
    with pytest.raises(ValueError, match="num_attention_heads"):
        from_hf_config({"hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 10})


@pytest.mark.parametrize(("layers", "hidden", "heads"), [(24, 2048, 16), (96, 12288, 96)])
def test_training_flops_follow_megatron_formula(layers: int, hidden: int, heads: int) -> None:
    s, v = 4096, 131072
    model = gpt("g", layers, hidden, heads, v)
    megatron = 72 * s * layers * hidden**2 * (1 + s / (6 * hidden) + v / (12 * layers * hidden))
    assert model.flops_per_token(s) * s == pytest.approx(megatron, rel=1e-9)
    assert model.flops_per_token(s, training=False) * 3 == pytest.approx(model.flops_per_token(s))


def test_causal_flag_halves_only_the_attention_term() -> None:
    m = preset("llama3-8b")
    full, causal = m.flops_per_token(8192), m.flops_per_token(8192, causal=True)
    attn = 3 * m.layers * m.attention_score_flops(8192)
    assert full - causal == pytest.approx(attn * (1 - (8192 + 1) / 2 / 8192))


def test_model_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_heads"):
        gpt("bad", 2, 64, 8).__class__("bad", 2, 64, 8, 256, 100, kv_heads=3)


# --- hardware ----------------------------------------------------------------------------------
def test_parse_cluster_and_defaults() -> None:
    c = parse_cluster("h100:8x64")
    assert c.world_size == 512 and c.intra.name == "nvlink4" and c.inter.name == "ib-ndr400" and c.nics_per_node == 8
    assert str(c) == "h100:8x64"
    assert parse_cluster("ASCEND910B:8x2").device.name == "ascend910b"
    assert c.device.peak_flops("bf16") == pytest.approx(989.4e12)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("b200:8x4", "unknown device 'b200'.*h100"),
        ("h100-8x4", "DEVICE:GPUS_PER_NODExNODES"),
        ("h100:8x0", "NODES '0'"),
        ("h100:axb", "GPUS_PER_NODE"),
    ],
)
def test_parse_cluster_errors_name_the_bad_part(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_cluster(text)


def test_missing_dtype_names_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"no 'fp8' peak.*bf16"):
        device("a100").peak_flops("fp8")
    assert device("h100").peak_flops("fp8") == pytest.approx(2 * device("h100").peak_flops("bf16"), rel=1e-3)


# --- kernels -----------------------------------------------------------------------------------
def test_gemm_efficiency_grows_with_size_and_saturates() -> None:
    h100 = device("h100")
    effs = []
    for n in (256, 1024, 4096, 16384):
        t = gemm_time(h100, n, n, n)
        effs.append(2 * n**3 / t / h100.peak_flops("bf16"))
    assert effs == sorted(effs)
    assert effs[0] < 0.1 and 0.9 * h100.eff.gemm_max < effs[-1] < h100.eff.gemm_max
    assert flops_efficiency(h100, 1e15, 1e6) == pytest.approx(h100.eff.gemm_max, rel=0.01)


def test_roofline_is_memory_bound_for_skinny_gemms() -> None:
    h100 = device("h100")
    t = gemm_time(h100, 1 << 20, 1024, 4)  # K=4: 8 flops per ~4 bytes
    nbytes = ((1 << 20) * 4 + 4 * 1024 + (1 << 20) * 1024) * 2
    assert t == pytest.approx(nbytes / (h100.hbm_bw * h100.eff.mem_max), rel=0.01)
    assert memory_time(h100, 3.35e9) > 1e-3


def test_attention_backward_costs_more_and_causal_half() -> None:
    h100 = device("h100")
    fwd = attention_time(h100, 8192, 8192, 32, 128, 128, causal=False)
    assert attention_time(h100, 8192, 8192, 32, 128, 128, causal=True) == pytest.approx(fwd / 2, rel=0.05)
    assert attention_time(h100, 8192, 8192, 32, 128, 128, causal=False, backward=True) > 2 * fwd


# --- collectives -------------------------------------------------------------------------------
def test_ring_all_reduce_matches_the_2_n_minus_1_over_n_formula() -> None:
    c = parse_cluster("h100:8x1")
    nbytes, n = 1e9, 8
    alpha, base = c.intra.latency_s, c.device.eff.collective_base_s
    expected = 2 * (n - 1) / n * nbytes / c.intra.effective_bw + 2 * (n - 1) * alpha + base
    assert all_reduce(c, Group(8, 8, 1), nbytes, "ring") == pytest.approx(expected)
    assert reduce_scatter(c, Group(8, 8, 1), nbytes) == pytest.approx(
        (n - 1) / n * nbytes / c.intra.effective_bw + (n - 1) * alpha + base
    )
    assert all_gather(c, Group(8, 8, 1), nbytes) == reduce_scatter(c, Group(8, 8, 1), nbytes)
    assert all_reduce(c, Group(1, 1, 1), nbytes) == 0.0


def test_hierarchical_groups_pay_for_the_nics() -> None:
    c = parse_cluster("h100:8x16")
    inside = reduce_scatter(c, Group(8, 8, 1), 1e9)
    across = reduce_scatter(c, Group(128, 8, 16), 1e9)
    sparse = reduce_scatter(c, Group(16, 1, 16), 1e9)  # one member per node: its own NIC share only
    assert inside < across < sparse
    assert sparse == pytest.approx(15 / 16 * 1e9 / c.inter_bw_per_device, rel=0.01)
    small, big = 64e3, 4e9
    g = Group(128, 8, 16)
    assert all_reduce(c, g, small, "tree") < all_reduce(c, g, small, "ring")
    assert all_reduce(c, g, big, "auto") == min(all_reduce(c, g, big, "ring"), all_reduce(c, g, big, "tree"))
    with pytest.raises(ValueError, match="unknown all-reduce algorithm"):
        all_reduce(c, g, big, "butterfly")


def test_placement_follows_axis_order() -> None:
    c = parse_cluster("h100:8x16")
    axes = [("tp", 8), ("dp", 8), ("pp", 2)]
    assert place_axes(c, axes, ("tp",)) == Group(8, 8, 1)
    assert place_axes(c, axes, ("dp",)) == Group(8, 1, 8)
    swapped = [("dp", 8), ("tp", 8), ("pp", 2)]
    assert place_axes(c, swapped, ("tp",)) == Group(8, 1, 8)
    assert place_axes(c, [("tp", 2), ("cp", 2), ("dp", 32)], ("cp", "dp")) == Group(64, 4, 16)
    assert place_axes(c, [("tp", 6), ("dp", 16)], ("tp",)).spans_nodes  # 6 does not tile a node
    with pytest.raises(KeyError, match="ep"):
        place_axes(c, axes, ("ep",))


def test_all_to_all_and_p2p() -> None:
    c = make_cluster("h100", 8, 4)
    local = all_to_all(c, Group(8, 8, 1), 1e9)
    spread = all_to_all(c, Group(32, 8, 4), 1e9)
    assert local < spread
    assert spread == pytest.approx(
        24 / 32 * 1e9 / c.inter_bw_per_device + c.intra.latency_s + c.inter.latency_s + c.device.eff.collective_base_s
    )
    assert p2p(c, 1e8, cross_node=False) < p2p(c, 1e8, cross_node=True)
    assert math.isclose(p2p(c, 0.0, cross_node=True), 0.0)
