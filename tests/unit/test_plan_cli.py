"""``meshfold plan``: the simulator and search behind the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshfold.tools.cli import main

LLAMA_8B_CONFIG = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["plan", *args, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_json_from_an_hf_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B_CONFIG))
    best = _json(capsys, "--model", str(cfg), "--cluster", "h100:8x8", "--seq", "2048", "--global-batch", "512")
    for key in ("plan", "step_time_s", "mfu", "tflops_per_device", "peak_memory_bytes", "solve_time_s"):
        assert key in best
    assert 0.0 < float(best["mfu"]) < 1.0  # type: ignore[arg-type]
    assert float(best["peak_memory_bytes"]) <= 80 * 2**30  # type: ignore[arg-type]


def test_fixed_evaluates_that_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "llama3-8b", "--cluster", "h100:8x8", "--seq", "2048", "--global-batch", "512"]
    fixed = _json(capsys, *args, "--fixed", "tp=8,dp=8")
    assert str(fixed["plan"]).startswith("dp8 tp8")
    searched = _json(capsys, *args)
    assert float(searched["step_time_s"]) <= float(fixed["step_time_s"])  # type: ignore[arg-type]


def test_mesh_pins_the_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    best = _json(capsys, "--model", "llama3-8b", "--cluster", "h100:8x8", "--seq", "2048", "--mesh", "dp=8,tp=8")
    assert str(best["plan"]).startswith("dp8 tp8")


def test_trace_is_a_chrome_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "step.json"
    _json(capsys, "--model", "llama3-8b", "--cluster", "h100:8x1", "--seq", "2048", "--global-batch", "16",
          "--fixed", "tp=8", "--trace", str(trace))  # fmt: skip
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" and e.get("dur", 0) > 0 for e in events)


def test_moe_plan_reports_all_to_all_volume(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "mixtral-8x7b", "--cluster", "h100:8x8", "--seq", "4096", "--global-batch", "256"]
    even = _json(capsys, *args, "--fixed", "tp=2,dp=32,ep=8,etp=1")
    skewed = _json(capsys, *args, "--fixed", "tp=2,dp=32,ep=8,etp=1", "--routing-imbalance", "1.5")
    assert float(even["a2a_bytes"]) > 0  # type: ignore[arg-type]
    assert float(skewed["a2a_bytes"]) == pytest.approx(1.5 * float(even["a2a_bytes"]))  # type: ignore[arg-type]
    assert float(skewed["step_time_s"]) > float(even["step_time_s"])  # type: ignore[arg-type]
    unfolded = _json(capsys, *args, "--fixed", "tp=2,dp=32,ep=8,moe_mapping=unfolded")
    assert "unfolded" in str(unfolded["plan"])
    assert main(["plan", *args, "--fixed", "tp=2,dp=32,ep=8,etp=1"]) == 0
    table = capsys.readouterr().out
    assert "a2a/dev (GiB)" in table and "etp1" in table
    dense = _json(capsys, "--model", "llama3-8b", "--cluster", "h100:8x8", "--seq", "2048", "--fixed", "tp=8,dp=8")
    assert dense["a2a_bytes"] == 0.0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model", "llama3-8b", "--cluster", "tpu:8x1"], "tpu"),
        (["--model", "no-such-model", "--cluster", "h100:8x1"], "no-such-model"),
        (["--model", "llama3-8b", "--cluster", "h100:8x1", "--fixed", "tp=3"], "tp"),
        (["--model", "mixtral-8x7b", "--cluster", "h100:8x1", "--routing-imbalance", "0.5"], "routing_imbalance"),
        (
            [
                "--model",
                "mixtral-8x7b",
                "--cluster",
                "h100:8x2",
                "--fixed",
                "tp=2,dp=8,ep=8,etp=1,moe_mapping=unfolded",
            ],
            "etp == tp violated",
        ),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert "meshfold plan:" in err and says in err


ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--cluster", "h100:8x1", "--seq", "128", "--global-batch", "8"]


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "mixtral-tiny", "mixtral-list-tiny", "deepseek-tiny"])
def test_zoo_models_are_read_off_their_modules(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A zoo model has no HF config: its spec is read off its modules, and counts its parameters exactly."""
    from meshfold.tools.plan_cli import load_model
    from meshfold.tools.zoo import build

    spec = load_model(name)
    model, _ = build(name)
    assert spec.param_count() == sum(p.numel() for p in model.parameters())
    best = _json(capsys, "--model", name, *SMALL)
    assert float(best["step_time_s"]) > 0  # type: ignore[arg-type]


def test_zoo_spec_dimensions() -> None:
    from meshfold.tools.plan_cli import load_model

    llama = load_model("llama-tiny")
    assert (llama.layers, llama.hidden, llama.heads, llama.kv_heads, llama.ffn_hidden, llama.vocab) == (
        2, 64, 4, 2, 128, 256
    )  # fmt: skip
    assert llama.gated_mlp and not llama.tied_embeddings
    gpt2 = load_model("gpt2-tiny")
    assert not gpt2.gated_mlp and gpt2.tied_embeddings and gpt2.learned_positions == 16 and gpt2.ffn_hidden == 256
    mixtral = load_model("mixtral-tiny")
    assert (mixtral.num_experts, mixtral.top_k, mixtral.moe_ffn_hidden) == (4, 2, 96)
    deepseek = load_model("deepseek-tiny")
    assert (deepseek.num_experts, deepseek.top_k, deepseek.shared_experts, deepseek.first_k_dense) == (8, 3, 2, 1)


def test_factory_with_the_pass_debug_contract(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``module:factory`` returning ``(model, example_inputs)``, imported from the current directory."""
    (tmp_path / "my_plan_models.py").write_text(
        "from meshfold.tools.zoo import build\n\ndef make():\n    return build('llama-tiny')\n"
    )
    monkeypatch.chdir(tmp_path)
    from_factory = _json(capsys, "--model", "my_plan_models:make", *SMALL, "--fixed", "dp=8")
    from_zoo = _json(capsys, "--model", "llama-tiny", *SMALL, "--fixed", "dp=8")
    assert from_factory["step_time_s"] == from_zoo["step_time_s"]
    assert from_factory["peak_memory_bytes"] == from_zoo["peak_memory_bytes"]


def test_non_transformer_says_what_plan_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "mlp", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "mlp" in err and "nn.Embedding" in err and "HF config" in err


def _readme_plan_section() -> str:
    """The guide's opening section (docs/simulator.md, up to its first sub-heading)."""
    text = (ROOT / "docs" / "simulator.md").read_text()
    return text[text.index("# Plan a cluster run") :].split("\n## ", 1)[0]


def test_readme_plan_commands_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every command of the simulator guide's "Plan a cluster run" block, and every ``--fixed`` its text names
    (with the block's first command), runs; ``config.json`` is a Llama3-8B config."""
    import re
    import shlex

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG))
    monkeypatch.chdir(tmp_path)
    section = _readme_plan_section()
    block = section.split("```")[1]
    commands = [shlex.split(line) for line in block.strip().splitlines()]
    assert commands and all(c[:2] == ["meshfold", "plan"] for c in commands)
    fixed = re.findall(r'--fixed "([^"]+)"', section)
    assert fixed, "the guide names a --fixed example"
    runs = [c[1:] for c in commands] + [[*commands[0][1:], "--fixed", f] for f in fixed]
    for argv in runs:
        assert main([*argv, "--json"]) == 0, (argv, capsys.readouterr().err)
        best = json.loads(capsys.readouterr().out)
        assert best["fits"], argv
