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
