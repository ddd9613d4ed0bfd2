"""The mesh from a world size (``meshfold.world``): every factorization is a candidate, each is
compiled and priced, and the fastest that fits memory wins; on one process, no ranks."""

from __future__ import annotations

import itertools
import math

import pytest

from meshfold.passes import PassError
from meshfold.passes.cost.liveness import size_text
from meshfold.tools.zoo import build
from meshfold.world import AXES, choose, factorizations, plans


@pytest.mark.parametrize("world", [1, 4, 8, 12])
def test_factorizations_are_every_way_of_writing_the_world_as_named_axes(world: int) -> None:
    names = ("pp", *AXES)
    every = {
        tuple((n, s) for n, s in zip(names, sizes, strict=True) if s > 1)
        for sizes in itertools.product(range(1, world + 1), repeat=len(names))
        if math.prod(sizes) == world
    } - {()}
    for pipeline in (False, True):
        got = [tuple(zip(m.names, m.sizes, strict=True)) for m in factorizations(world, pipeline)]
        want = {axes for axes in every if (axes[0][0] == "pp") == pipeline} if world > 1 else {(("dp", 1),)}
        assert len(got) == len(set(got)), "a factorization is listed twice"
        assert set(got) == want, set(got) ^ want


def test_each_mesh_is_tried_under_its_presets_and_the_solve() -> None:
    got = {(str(m), p) for m, p in plans(4)}
    assert ("mesh<dp=4>", "fsdp") in got and ("mesh<dp=4>", "ddp") in got and ("mesh<dp=4>", "auto") in got
    assert ("mesh<dp=2, tp=2>", "fsdp+tp") in got and ("mesh<cp=4>", "cp") in got
    assert {p for m, p in plans(4, pipeline=True) if str(m) == "mesh<pp=4>"} == {"pp", "pp+auto"}
    assert ("mesh<pp=2, dp=2>", "pp+fsdp") in {(str(m), p) for m, p in plans(4, pipeline=True)}


@pytest.fixture(scope="module")
def mlp_choice():  # type: ignore[no-untyped-def]
    model, inputs = build("mlp")
    return choose(model, inputs, 4, {})


def test_the_choice_is_the_fastest_candidate_and_its_compile_is_the_program(mlp_choice) -> None:  # type: ignore[no-untyped-def]
    choice, result = mlp_choice
    runs = [c for c in choice.candidates if c.runs]
    assert len(choice.candidates) == len(plans(4)) and len(runs) >= 2
    assert choice.chosen.step_s == min(c.step_s for c in runs if c.step_s is not None)
    assert result.graph.mesh == choice.chosen.mesh and result.options.effective_plan().preset == choice.chosen.plan
    lines = choice.lines()
    assert lines[0].startswith(f"mesh: {choice.chosen.label} chosen for 4 ranks from {len(choice.candidates)}")
    assert len(lines) == 1 + len(choice.candidates)


def test_a_memory_bound_refuses_the_candidates_over_it(mlp_choice) -> None:  # type: ignore[no-untyped-def]
    unbounded, _ = mlp_choice
    peaks = sorted(c.peak_bytes for c in unbounded.candidates if c.peak_bytes is not None)
    bound = int(peaks[len(peaks) // 2])
    model, inputs = build("mlp")
    choice, _ = choose(model, inputs, 4, {"memory": bound})
    runs = [c for c in choice.candidates if c.runs]
    assert runs and all(c.peak_bytes is not None and c.peak_bytes <= bound for c in runs)
    over = {c.label for c in unbounded.candidates if c.peak_bytes is not None and c.peak_bytes > bound}
    changed = {c.label for c in choice.candidates if c.refused} | {
        c.label
        for c in runs
        if c.label in over  # NOTE: the memory pass recomputed it under the bound
    }
    assert over <= changed
    assert f"under {size_text(bound)} per rank" in choice.lines()[0]


def test_a_world_nothing_runs_on_is_refused_naming_every_candidate() -> None:
    model, inputs = build("mlp")
    with pytest.raises(PassError, match=r"no mesh of 2 ranks runs this model") as e:
        choose(model, inputs, 2, {"memory": 64})
    for mesh, plan in plans(2):
        assert f"{','.join(f'{n}={s}' for n, s in zip(mesh.names, mesh.sizes, strict=True))} {plan}: refused" in str(
            e.value
        )
