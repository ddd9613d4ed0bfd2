"""Capture traces one copy of each run of identical layers and stamps the others: the graph is the
very program a capture of every layer gives (same ops in the same order, reading the same values,
the same inputs, outputs and provenance), and layers that differ in any way are traced."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from meshfold import capture
from meshfold.ir.graph import first_difference
from meshfold.tracing import layer_runs, tracer
from meshfold.tracing.fakes import fake_copies
from meshfold.tracing.layer_runs import Run, find_runs
from meshfold.tracing.moe_layers import experts_as_ops
from meshfold.tracing.unroll import Unfoldable, unroll
from tests.dist.hf_models import build_hf
from tests.unit.test_solve_scale import _hf


def _runs(model: nn.Module, inputs: tuple[Any, ...]) -> list[Run]:
    with fake_copies(model, inputs) as (_, fake), experts_as_ops(model):
        return find_runs(model, fake)


def _same_as_whole(model: nn.Module, inputs: tuple[Any, ...]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folded = capture(model, inputs)
        whole = capture(model, inputs, fold=False)
    assert first_difference(folded, whole) is None, first_difference(folded, whole)


@pytest.mark.hf
@pytest.mark.parametrize(
    ("kind", "layers", "runs"),
    [
        ("llama", 6, [(1, 5)]),
        ("qwen2", 5, [(1, 4)]),
        ("mixtral", 4, [(1, 3)]),
        ("gpt2", 5, [(1, 4)]),
        # NOTE: a dense first layer, then MoE layers: layer 1 reads a dense layer, 2.. read MoE ones
        ("deepseek-v3", 6, [(2, 5)]),
        # NOTE: convolution and attention layers take turns: no two neighbours alike, nothing folds
        ("lfm2", 8, []),
    ],
)
def test_real_models_fold_their_middle_layers_into_the_same_program(
    kind: str, layers: int, runs: list[tuple[int, int]]
) -> None:
    with torch.device("meta"):
        model = _hf(kind, layers)
    ids = torch.zeros(2, 32, dtype=torch.long)
    path = "transformer.h" if kind == "gpt2" else "model.layers"
    assert _runs(model, (ids, ids)) == [Run(path, a, b) for a, b in runs]
    _same_as_whole(model, (ids, ids))


@pytest.mark.hf
def test_layers_given_different_masks_are_different_kinds() -> None:
    # NOTE: Qwen2 with sliding-window attention from layer 2 on: layers 0-1 attend causally, 2-6 through
    # the sliding mask; layer 2 reads a full-attention layer, so the run of alike layers is 3-6
    import transformers as hf

    from meshfold.tools.zoo.hf_zoo import _hf_loss_cls

    config = hf.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=7,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=2,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = _hf_loss_cls(hf.Qwen2ForCausalLM)(config)
    ids = torch.zeros(2, 32, dtype=torch.long)
    assert _runs(model, (ids, ids)) == [Run("model.layers", 3, 6)]
    _same_as_whole(model, (ids, ids))


class _Block(nn.Module):
    def __init__(self, idx: int, how: str) -> None:
        super().__init__()
        self.idx, self.how = idx, how
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5 if how == "dropout" else 0.0)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        y = self.drop(torch.relu(self.fc(x))) * scale
        if self.how == "parity" and self.idx % 2:
            y = y * 2
        if self.how == "own":  # NOTE: a tensor made in the forward, on the CPU
            y = y + torch.ones(16)
        return x + y


class _Stack(nn.Module):
    """Six blocks; ``how`` picks what makes some of them differ (or not)."""

    def __init__(self, how: str, n: int = 6) -> None:
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList(_Block(i, how) for i in range(n))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen = []
        for i, block in enumerate(self.blocks):
            x = block(x, 3.0 if self.how == "position" and i == 3 else 1.0)
            if self.how == "between":
                x = x * 0.5
            seen.append(x)
        if self.how == "collect":
            x = x + sum(seen[:-1])
        if self.how == "last":
            x = x * 2
        return ((x - y) ** 2).mean()


@pytest.mark.parametrize(
    ("how", "runs"),
    [
        ("plain", [(1, 5)]),
        ("last", [(1, 5)]),
        # NOTE: every layer draws its own random numbers, copies included, in the same order
        ("dropout", [(1, 5)]),
        # NOTE: the forward branches on the block's own index: no two neighbours alike
        ("parity", []),
        # NOTE: the loop hands block 3 another argument; blocks 4 and 5 alone are too short a run
        ("position", []),
        # NOTE: the code around the blocks computes between them: each reads its own op of it
        ("between", []),
        # NOTE: the code after the loop reads every block's output: none can be left out
        ("collect", []),
    ],
)
def test_layers_that_differ_are_traced(how: str, runs: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    model = _Stack(how)
    inputs = (torch.randn(4, 16), torch.randn(4, 16))
    assert _runs(model, inputs) == [Run("blocks", a, b) for a, b in runs]
    _same_as_whole(model, inputs)


def test_layers_meta_tensors_cannot_run_are_recorded_on_fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: the layers are recorded on meta tensors; a block adding a CPU tensor it makes in its
    # forward cannot run on them, and the model is recorded on fakes instead, with the same runs
    tried: list[bool] = []
    real = layer_runs._found

    def spy(model: nn.Module, inputs: Any, lists: Any, on_meta: Any) -> list[Run]:
        tried.append(bool(on_meta))
        return real(model, inputs, lists, on_meta)

    monkeypatch.setattr(layer_runs, "_found", spy)
    inputs = (torch.randn(4, 16), torch.randn(4, 16))
    assert _runs(_Stack("plain"), inputs) == [Run("blocks", 1, 5)]
    assert tried == [True]
    tried.clear()
    torch.manual_seed(0)
    model = _Stack("own")
    assert _runs(model, inputs) == [Run("blocks", 1, 5)]
    assert tried == [True, False]
    _same_as_whole(model, inputs)


@pytest.mark.hf
@pytest.mark.parametrize(("kind", "layers"), [("llama", 6), ("deepseek-v3", 6)])
def test_meta_and_fake_records_find_the_same_runs(kind: str, layers: int) -> None:
    # NOTE: on meta, attention decomposes into other ops than on a CPU fake; each layer alike, so the
    # runs are the same (and the reduced model's record is checked on meta too)
    with torch.device("meta"):
        model = _hf(kind, layers)
    ids = torch.zeros(2, 32, dtype=torch.long)
    with fake_copies(model, (ids, ids)) as (_, fake), experts_as_ops(model):
        lists = layer_runs._lists(model)
        layers_ = [child for _, mod in lists for child in mod.children()]
        on_meta = layer_runs._found(model, fake, lists, layers_)
        assert on_meta and on_meta == layer_runs._found(model, fake, lists, [])


def test_a_run_that_depends_on_its_length_is_not_folded() -> None:
    # NOTE: the loop scales the first half of the blocks: 1-3 and 4-7 run alike, but with blocks 2, 5
    # and 6 left out the half falls elsewhere (block 3 is no longer scaled), which the reduced
    # model's own record shows
    class Halves(_Stack):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for i, block in enumerate(self.blocks):
                x = block(x, 3.0 if i < len(self.blocks) // 2 else 1.0)
            return ((x - y) ** 2).mean()

    model = Halves("plain", 8)
    inputs = (torch.randn(4, 16), torch.randn(4, 16))
    lists = layer_runs._lists(model)
    with fake_copies(model, inputs) as (_, fake):
        whole = layer_runs._runs(layer_runs._record(model, fake, lists), lists)
    assert whole == [Run("blocks", 1, 3), Run("blocks", 4, 7)]
    assert _runs(model, inputs) == []
    _same_as_whole(model, inputs)


@pytest.mark.hf
def test_deep_hf_models_of_the_rank_tests_fold() -> None:
    # NOTE: tests/dist/test_equivalence.py compares these with single device on 4 ranks
    for arch, layers, path in (("qwen2", 5, "model.layers"), ("gpt2", 4, "transformer.h")):
        model, inputs = build_hf(arch, layers)
        assert _runs(model, inputs) == [Run(path, 1, layers - 1)]


def test_layers_that_do_not_line_up_are_traced_after_all(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: told (wrongly) that blocks 1-4 run alike, the stamping finds block 1 (odd: one op more)
    # and block 4 unlike and says so; capture then traces every block
    torch.manual_seed(0)
    model = _Stack("parity")
    inputs = (torch.randn(4, 16), torch.randn(4, 16))
    monkeypatch.setattr(tracer, "find_runs", lambda *_: [Run("blocks", 1, 4)])
    with layer_runs.reduced(model, [Run("blocks", 1, 4)]):
        reduced = capture(model, inputs, fold=False)
    with pytest.raises(Unfoldable, match=r"blocks\.1 and blocks\.4"):
        unroll(reduced, [Run("blocks", 1, 4)])
    _same_as_whole(model, inputs)
