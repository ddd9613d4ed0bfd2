"""Clusters of node groups with different NICs: parsing, pricing, and the pipeline placement."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshfold.passes.cost import comm
from meshfold.sim import NodeGroup, ParallelConfig, TrainSpec, parse_cluster, preset, simulate
from meshfold.tools.bench.sim.heterogeneous_network import MIXED, interleaved

# NOTE: InfiniBand NDR 400 Gb/s and RoCE 200 GbE per GPU (hardware.LINKS).
IB_BW, ROCE_BW = 50e9 * 0.90, 25e9 * 0.85


def test_parse_node_groups_fastest_first() -> None:
    c = parse_cluster("h100:8x4@roce+h100:8x4@ib")
    assert c.world_size == 64 and c.heterogeneous
    assert [g.inter.name for g in c.groups] == ["ib-ndr400", "roce200"]
    assert c.inter.name == "roce200"  # NOTE: the cluster as a whole is as fast as its slowest NIC
    assert str(c) == "h100:8x4@ib-ndr400+h100:8x4@roce200"
    assert parse_cluster("h100:8x2@roce").inter.name == "roce200" and not parse_cluster("h100:8x2").heterogeneous


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("h100:8x4@foo", "unknown NIC 'foo' after @"),
        ("h100:8x4@ib+a100:8x4@ib", "must share the device and GPUs per node"),
        ("h100:8x4@ib+h100:8", r"DEVICE:GPUS_PER_NODExNODES\[@NIC\]"),
    ],
)
def test_bad_cluster_text_names_the_part(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_cluster(text)


def test_a_dp_collective_across_groups_runs_at_the_slower_nic() -> None:
    mixed = parse_cluster(MIXED)
    axes = (("tp", 8), ("dp", 16))  # NOTE: dp strides over all 16 nodes, both groups
    view = comm.instance_view(mixed, axes, ("dp",), ())
    assert view.inter_bw_per_device == pytest.approx(ROCE_BW)
    group = comm.place_axes(mixed, axes, ("dp",))
    roce = parse_cluster("h100:8x16@roce")
    assert comm.all_reduce(view, group, 1e9) == pytest.approx(comm.all_reduce(roce, group, 1e9))
    inside = comm.instance_view(mixed, (("tp", 8), ("dp", 8), ("pp", 2)), ("dp",), (("pp", 0),))
    assert inside.inter_bw_per_device == pytest.approx(IB_BW)
    hop, cross = comm.hop(mixed, (("tp", 8), ("dp", 8), ("pp", 2)), "pp", 0)
    assert cross and hop.inter_bw_per_device == pytest.approx(ROCE_BW)


def test_aware_placement_is_priced_no_slower_than_handing_nodes_out_in_turn() -> None:
    mixed = parse_cluster(MIXED)
    model, cfg, train = preset("llama3-70b"), ParallelConfig(dp=8, tp=8, pp=2), TrainSpec(8192, 128)
    aware = simulate(model, mixed, cfg, train, timeline=False)
    blind = simulate(model, interleaved(mixed), cfg, train, timeline=False)
    assert aware.step_time_s < blind.step_time_s
    dp = dict(aware.breakdown)["dp exposed"], dict(blind.breakdown)["dp exposed"]
    assert dp[0] < dp[1]  # NOTE: stage 0 reduces over IB; the RoCE stage hides its reduction behind the drain
    ib = simulate(model, parse_cluster("h100:8x16@ib"), cfg, train, timeline=False)
    roce = simulate(model, parse_cluster("h100:8x16@roce"), cfg, train, timeline=False)
    assert ib.step_time_s <= aware.step_time_s <= roce.step_time_s


def test_node_groups_of_one_nic_price_as_one_cluster() -> None:
    c = parse_cluster("h100:8x4")
    same = replace(c, groups=(NodeGroup(2, c.inter, 8), NodeGroup(2, c.inter, 8)))
    assert same.heterogeneous
    model, cfg, train = preset("llama3-8b"), ParallelConfig(dp=4, tp=4, pp=2), TrainSpec(8192, 32)
    assert (
        simulate(model, same, cfg, train, timeline=False).step_time_s
        == simulate(model, c, cfg, train, timeline=False).step_time_s
    )
