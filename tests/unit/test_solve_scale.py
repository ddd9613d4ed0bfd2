"""The sharding solve at depth: real models' decoder layers are found as repeats, the program does
not grow with them, the search is bounded by work (so plans never depend on load), and ``auto``
is never worse than the preset the mesh names (no ranks needed)."""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections import OrderedDict
from contextlib import nullcontext
from typing import Any

import highspy
import numpy as np
import pytest
import torch
from scipy.sparse import csc_array

from meshfold import capture, ir
from meshfold.passes import PassContext, parse_pipeline
from meshfold.passes.blocks import mirrored_blocks, mirrored_ops
from meshfold.passes.options import Options
from meshfold.passes.sharding.ilp import milp
from meshfold.passes.sharding.ilp.milp import Columns, MilpAnswer, solve_milp
from meshfold.passes.sharding.ilp.problem import AxisStats
from meshfold.passes.sharding.plans import Plan
from meshfold.session import compile_model
from meshfold.target.hardware import parse_cluster
from meshfold.tools.zoo import build
from meshfold.tools.zoo.hf_zoo import DEEPSEEK_V3_TINY, _hf_loss_cls

_SMALL = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "attn_implementation": "sdpa"}


def _hf(kind: str, layers: int) -> Any:
    import transformers as hf

    if kind == "gpt2":
        config: Any = hf.GPT2Config(vocab_size=512, n_embd=64, n_head=4, n_layer=layers, n_positions=64)
        return _hf_loss_cls(hf.GPT2LMHeadModel)(config)
    if kind == "deepseek-v3":
        config = hf.DeepseekV3Config(**_SMALL, num_hidden_layers=layers, **DEEPSEEK_V3_TINY)
        return _hf_loss_cls(hf.DeepseekV3ForCausalLM)(config)
    if kind == "lfm2":
        types = ["conv", "full_attention"] * (layers // 2)
        config = hf.Lfm2Config(**_SMALL, num_hidden_layers=layers, num_key_value_heads=2, layer_types=types)
        return _hf_loss_cls(hf.Lfm2ForCausalLM)(config)
    cls, extra = {
        "llama": ("Llama", {}),
        "qwen2": ("Qwen2", {}),
        "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    }[kind]
    config = getattr(hf, f"{cls}Config")(
        **_SMALL, num_hidden_layers=layers, num_key_value_heads=2, intermediate_size=128, **extra
    )
    return _hf_loss_cls(getattr(hf, f"{cls}ForCausalLM"))(config)


def _cleaned(kind: str, layers: int) -> ir.Graph:
    with torch.device("meta"):
        model = _hf(kind, layers)
    ids = torch.zeros(2, 32, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = capture(model, (ids, ids))
    return parse_pipeline("cleanup").run(PassContext(), g)[0]


@pytest.mark.hf
@pytest.mark.parametrize(
    ("kind", "reps"),
    [
        ("llama", (None, 0, 0, 0)),
        ("qwen2", (None, 0, 0)),
        ("mixtral", (None, 0, 0)),
        ("gpt2", (None, 0, 0)),
        # NOTE: a dense first layer, then MoE ones: one plan per kind
        ("deepseek-v3", (None, None, 1, 1)),
        # NOTE: a hybrid stack, short-convolution and attention layers taking turns
        ("lfm2", (None, None, 0, 1)),
    ],
)
def test_real_models_decoder_layers_are_found_as_repeats(kind: str, reps: tuple[int | None, ...]) -> None:
    """``reps[i]``: the layer that layer ``i`` repeats (None: the first of its kind)."""
    pytest.importorskip("transformers")
    g = _cleaned(kind, len(reps))
    mirrors = mirrored_blocks(g)
    family = {b.rsplit(".", 1)[0] for b in mirrors}
    assert len(family) == 1, mirrors
    prefix = family.pop()
    assert mirrors == {f"{prefix}.{i}": f"{prefix}.{r}" for i, r in enumerate(reps) if r is not None}, mirrors
    # NOTE: both phases of a layer repeat, op for op
    pairs = mirrored_ops(g)
    phases = {g.ops[i].prov.phase for i in pairs}
    assert phases == {"fwd", "bwd"}, phases
    for i, r in pairs.items():
        assert g.ops[i].target == g.ops[r].target
        assert [v.type for v in g.ops[i].results] == [v.type for v in g.ops[r].results]


def _solve_stats(g: ir.Graph) -> tuple[tuple[AxisStats, ...], dict[str, ir.Layout]]:
    ctx = PassContext(Options(mesh=ir.Mesh.parse("dp=2,tp=2"), plan=Plan.of("auto"), cluster=parse_cluster("h100:8x1")))
    out, _ = parse_pipeline("sharding").run(ctx, g)
    stats = ctx.stats["sharding.solve"]
    assert isinstance(stats, tuple)
    return stats, {i.name: i.value.layout for i in out.inputs}


@pytest.mark.hf
def test_the_program_does_not_grow_with_depth_and_every_layer_gets_one_plan() -> None:
    pytest.importorskip("transformers")
    shallow, _ = _solve_stats(_cleaned("llama", 2))
    deep, layouts = _solve_stats(_cleaned("llama", 6))
    for a, b in zip(shallow, deep, strict=True):
        assert (b.binaries, b.columns) == (a.binaries, a.columns), (a, b)
        assert b.shared_ops == 5 * a.shared_ops, (a, b)  # NOTE: layers 1..5 against layer 1
        assert b.folded > a.folded and b.optimal and b.gap <= 1e-3, b
    for name, lay in layouts.items():
        if name.startswith("model.layers.") and not name.startswith("model.layers.0."):
            assert lay == layouts["model.layers.0." + name.split(".", 3)[3]], name


@pytest.mark.hf
def test_a_mirrored_layers_moves_taken_from_its_first_copy_give_the_same_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The solve skips building the moves of a value a repeated layer makes when the first layer's
    copy has the same consumers; the program, its optimum and the plan are what building them all
    gives."""
    pytest.importorskip("transformers")
    from meshfold.passes.sharding.ilp.program import AxisProgram

    g = _cleaned("llama", 4)
    taken = []
    real = AxisProgram._mirror

    def counted(self: AxisProgram, *args: Any) -> Any:
        w = real(self, *args)
        taken.append(w is not None)
        return w

    monkeypatch.setattr(AxisProgram, "_mirror", counted)
    fast, fast_layouts = _solve_stats(g)
    assert sum(taken) > len(taken) // 2, (sum(taken), len(taken))
    monkeypatch.setattr(AxisProgram, "_mirror", lambda self, *args: None)
    full, full_layouts = _solve_stats(g)
    assert fast_layouts == full_layouts
    for a, b in zip(fast, full, strict=True):
        assert (a.binaries, a.columns, a.rows, a.folded) == (b.binaries, b.columns, b.rows, b.folded), (a, b)
        assert a.objective == pytest.approx(b.objective, rel=1e-9), (a, b)


def test_folding_a_repeated_build_keeps_the_optimum() -> None:
    """Two identical copies of a set of columns under the same rows solve to the optimum of one
    copy with its cost doubled."""

    def program(fold: bool) -> MilpAnswer:
        m = Columns()
        x = [m.var(c, integer=True) for c in (3.0, 1.0, 2.0)]
        m.rows.append(({v: 1.0 for v in x}, 1.0, 1.0))

        def copy() -> None:
            # NOTE: pays 5 unless the cheap choice is avoided; both copies read the same x
            y = m.var(5.0)
            m.rows.append(({y: 1.0, x[1]: -1.0}, 0.0, np.inf))

        for _ in range(2):
            if fold:
                m.once("copy", copy)
            else:
                copy()
        if fold:
            assert m.folded == 1 and len(m.cost) == 4
        return m.solve(gap=1e-6, node_limit=100)

    folded, plain = program(True), program(False)
    assert folded.objective == pytest.approx(plain.objective) == pytest.approx(2.0)


def _market_split() -> tuple[Any, ...]:
    """A market-split instance: few rows, yet branch and bound needs tens of thousands of nodes."""
    rng = np.random.default_rng(0)
    m, n = 3, 24
    a = rng.integers(0, 100, size=(m, n)).astype(float)
    d = np.floor(a.sum(axis=1) / 2)
    matrix = csc_array(np.hstack([a, np.eye(m), -np.eye(m)]))
    cost = np.r_[np.zeros(n), np.ones(2 * m)]
    upper = np.r_[np.ones(n), np.full(2 * m, np.inf)]
    return cost, np.zeros(n + 2 * m), upper, [1] * n + [0] * (2 * m), matrix, d, d


def test_a_search_stopped_by_its_node_limit_says_so_and_is_repeatable(monkeypatch: pytest.MonkeyPatch) -> None:
    first = solve_milp(*_market_split(), gap=1e-4, node_limit=5)
    monkeypatch.setattr(milp, "_KEPT", OrderedDict())  # NOTE: HiGHS solves it again, not the kept answer
    again = solve_milp(*_market_split(), gap=1e-4, node_limit=5)
    assert not first.optimal and first.nodes <= 5, first
    assert first.x is not None and first.bound < first.objective and 0 < first.gap <= 1, first
    # NOTE: a unit of work, not time: the same program stops at the same point
    assert again.x is not None and np.array_equal(first.x, again.x) and again.objective == first.objective


def test_the_same_program_is_solved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program solved before in this process gets the kept answer (a copy); any change to it, a
    cost or a setting, is solved anew, and so is every program after ``forget``."""
    calls = []

    class Counted(highspy.Highs):  # type: ignore[misc]
        def run(self) -> Any:
            calls.append(self)
            return super().run()

    monkeypatch.setattr(milp.highspy, "Highs", Counted)
    monkeypatch.setattr(milp, "_KEPT", OrderedDict())
    first = solve_milp(*_market_split(), gap=1e-4, node_limit=5)
    again = solve_milp(*_market_split(), gap=1e-4, node_limit=5)
    assert len(calls) == 1 and first.x is not None and again.x is not None
    assert again.x is not first.x and np.array_equal(first.x, again.x) and again.objective == first.objective
    cost, *rest = _market_split()
    cost[-1] = 2.0
    solve_milp(cost, *rest, gap=1e-4, node_limit=5)
    solve_milp(*_market_split(), gap=1e-4, node_limit=6)
    assert len(calls) == 3
    milp.forget()
    solve_milp(*_market_split(), gap=1e-4, node_limit=5)
    assert len(calls) == 4


def test_a_plan_stopped_early_warns_with_its_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Columns.solve

    def stopped(self: Columns, **kwargs: Any) -> MilpAnswer:
        a = real(self, **kwargs)
        return dataclasses.replace(a, optimal=False, bound=0.75 * a.objective)

    monkeypatch.setattr(Columns, "solve", stopped)
    model, inputs = build("mlp")
    opts = Options.of(mesh="dp=2,tp=2", plan="auto", pipeline="cleanup,sharding")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compile_model(model, inputs, opts, status=lambda _m: nullcontext())
    said = [str(w.message) for w in caught]
    for axis in ("dp", "tp"):
        pattern = (
            rf"mesh axis '{axis}' stopped at its node limit .* within 25\.0% of optimal; raise sharding\{{node-limit"
        )
        assert any(re.search(pattern, m) for m in said), said
    stats = result.stats["sharding.solve"]
    assert isinstance(stats, tuple) and all(not s.optimal and s.gap == pytest.approx(0.25) for s in stats)


def test_a_plan_stopped_early_is_no_worse_than_any_preset_of_the_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A search the node limit stopped vouches only for beating the preset it started from, so every
    preset the mesh's axis names allow is priced as well and the cheapest plan of all is kept; a
    proven optimum needs none of that."""
    model, inputs = build("mlp")
    opts = Options.of(mesh="dp=2,tp=2", plan="auto", cluster="h100:8x1", pipeline="cleanup,sharding")

    def compiled() -> dict[str, object]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return compile_model(model, inputs, opts, status=lambda _m: nullcontext()).stats

    proven = compiled()
    assert "sharding.presets" not in proven
    real = Columns.solve

    def stopped(self: Columns, **kwargs: Any) -> MilpAnswer:
        return dataclasses.replace(real(self, **kwargs), optimal=False)

    monkeypatch.setattr(Columns, "solve", stopped)
    stats = compiled()
    presets = stats["sharding.presets"]
    assert isinstance(presets, dict) and set(presets) == {"fsdp+tp", "ddp+tp"}, presets
    step = stats["sharding.step_time"]
    assert isinstance(step, float) and all(step <= t * (1 + 1e-9) for t in presets.values()), (step, presets)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "mlp"])
def test_auto_models_no_slower_than_the_preset_and_gives_the_same_plan_every_time(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, inputs = build(name)
    opts = Options.of(mesh="dp=2,tp=2", plan="auto", cluster="h100:8x1", pipeline="cleanup,sharding,boxing")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = compile_model(model, inputs, opts, status=lambda _m: nullcontext())
        monkeypatch.setattr(milp, "_KEPT", OrderedDict())  # NOTE: HiGHS solves again, not the kept answers
        again = compile_model(model, inputs, opts, status=lambda _m: nullcontext())
    preset = first.stats["sharding.preset"]
    assert isinstance(preset, tuple) and preset[0] == "fsdp+tp"
    step = first.stats["sharding.step_time"]
    assert isinstance(step, float) and 0 < step <= preset[1] * (1 + 1e-9), (step, preset)
    assert str(first.graph) == str(again.graph)


def test_pass_debug_reports_the_solve(capsys: pytest.CaptureFixture[str]) -> None:
    from meshfold.tools.pass_debug import main

    argv = ["mlp", "--mesh", "dp=2,tp=2", "--plan", "auto", "-p", "cleanup,sharding", "--no-color"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sharding solve" in out
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│ dp") or line.startswith("│ tp")]
    assert [r[0].strip() for r in rows] == ["dp", "tp"], out
    assert all(r[-1].strip() == "optimal" and r[-2].strip() == "0.00%" for r in rows), rows
    step = re.search(r"modelled step time ([\d.]+) ms; the fsdp\+tp preset's layouts: ([\d.]+) ms", out)
    assert step is not None and float(step.group(1)) <= float(step.group(2)), out
