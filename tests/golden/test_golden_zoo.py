"""Whole-model golden dumps: each built-in zoo model after capture + cleanup, byte for byte.

HF models are left out of the whole dumps because their graphs follow the installed transformers
version; they are covered by round-trip and numerics tests in tests/models.
"""

from __future__ import annotations

import pytest
import torch

import ir
from backends.interpret import interpret
from compiler import compile_model
from compiler.zoo import build
from tests.golden.harness import GOLDEN_DIR, expect_text

BUILTINS = ["mlp", "gpt2-tiny", "llama-tiny", "mixtral-tiny", "mixtral-list-tiny"]


@pytest.mark.parametrize("name", BUILTINS)
def test_zoo_after_cleanup_matches_golden_and_eager(name: str) -> None:
    model, inputs = build(name)
    result = compile_model(model, inputs, "cleanup,verify")
    assert len(result.graph.ops) < len(result.captured.ops)
    text = str(result.graph)
    expect_text(GOLDEN_DIR / "zoo" / f"{name}.ir", text)
    assert str(ir.parse(text)) == text

    loss = model(*inputs)
    loss.backward()
    feeds = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    feeds |= {i.name: x for i, x in zip([i for i in result.graph.inputs if i.kind == "input"], inputs, strict=True)}
    got = interpret(result.graph, feeds)
    torch.testing.assert_close(got[("out", "0")], loss.detach(), rtol=1e-5, atol=1e-6)
    for pname, p in model.named_parameters():
        torch.testing.assert_close(got[("grad", pname)], p.grad, rtol=1e-5, atol=1e-6)
