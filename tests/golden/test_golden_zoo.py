"""Whole-model golden dumps: each built-in zoo model after capture + cleanup, byte for byte.

HF models are left out of the whole dumps because their graphs follow the installed transformers
version; they are covered by round-trip and numerics tests in tests/models.
"""

from __future__ import annotations

import pytest

from meshfold import compile_model, ir
from meshfold.tools.zoo import build
from tests.golden.harness import GOLDEN_DIR, expect_text
from tests.models.test_capture import assert_graph_matches_eager

BUILTINS = ["mlp", "gpt2-tiny", "llama-tiny", "mixtral-tiny", "mixtral-list-tiny", "moe-loop-tiny"]


@pytest.mark.parametrize("name", BUILTINS)
def test_zoo_after_cleanup_matches_golden_and_eager(name: str) -> None:
    model, inputs = build(name)
    result = compile_model(model, inputs, "cleanup,verify")
    assert len(result.graph.ops) < len(result.captured.ops)
    text = str(result.graph)
    expect_text(GOLDEN_DIR / "zoo" / f"{name}.ir", text)
    assert str(ir.parse(text)) == text

    assert_graph_matches_eager(result.graph, model, inputs)
