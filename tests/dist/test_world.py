"""``parallelize(model, world, inputs, plan="auto")``: the mesh chosen from a rank count (or a 1-D
mesh without dim names) is built on every rank alike, and the program trains as the single-device
model does (loss, every gradient, the parameters after AdamW steps)."""

from __future__ import annotations

import math

import pytest

from tests.dist.conftest import RankPools

WORLD = "tests.dist.cases_world"


@pytest.mark.parametrize(("model", "world"), [("llama-tiny", 4), ("mlp", 2)])
def test_a_world_size_trains_on_the_mesh_it_chose_as_one_device_does(
    rank_pools: RankPools, model: str, world: int
) -> None:
    results = rank_pools.get(world).run(
        "tests.dist.cases:equivalence", model=model, shape=(world,), names=(), plan="auto"
    )
    mesh = results[0]["mesh"]
    assert all(r["mesh"] == mesh for r in results), "ranks built different meshes"
    names, sizes = mesh
    head = results[0]["report"][0]
    label = ",".join(f"{n}={s}" for n, s in zip(names, sizes, strict=True))
    assert head.startswith(f"mesh: {label} ") and f"chosen for {world} ranks" in head, head
    assert all(r["report"] == results[0]["report"] for r in results)
    assert results[0]["worst_grad_abs_diff"] < 1e-4


@pytest.mark.parametrize("unnamed_mesh", [False, True])
def test_a_world_without_plan_auto_is_refused_on_every_rank(rank_pools: RankPools, unnamed_mesh: bool) -> None:
    results = rank_pools.get(2).run(f"{WORLD}:refused", plan="fsdp", unnamed_mesh=unnamed_mesh)
    said = results[0]["said"]
    assert all(r["said"] == said for r in results)
    assert "a world of 2 ranks" in said and "needs plan='auto'" in said, said


def test_a_world_size_other_than_the_process_groups_is_refused(rank_pools: RankPools) -> None:
    results = rank_pools.get(2).run(f"{WORLD}:wrong_world")
    assert all(r["said"] == "the world given has 3 ranks but torch.distributed has 2; give 2" for r in results), results


def test_a_class_decorated_with_a_world_chooses_its_mesh_at_construction(rank_pools: RankPools) -> None:
    results = rank_pools.get(2).run(f"{WORLD}:decorated")
    assert all(r["mesh"] == results[0]["mesh"] for r in results)
    assert math.prod(results[0]["mesh"][1]) == 2, results[0]["mesh"]
    assert all(r["worst"] < 1e-5 for r in results), results


def test_a_world_with_pp_chooses_among_pipelines_and_trains_as_one_device_does(rank_pools: RankPools) -> None:
    results = rank_pools.get(2).run(
        "tests.dist.cases_pipeline:pipelined_equivalence", shape=(2,), names=(), plan="auto", pp={"microbatches": 2}
    )
    names, sizes = results[0]["mesh"]
    assert all(r["mesh"] == (names, sizes) for r in results)
    # NOTE: every pipeline of 2 ranks is pp=2; its module's mesh gives the stages a dp axis of one rank
    assert names[0] == "pp" and sizes[0] == 2 and math.prod(sizes) == 2, (names, sizes)
    head = results[0]["report"][0]
    assert head.startswith("mesh: pp=2 ") and "from 2 candidates" in head, head
