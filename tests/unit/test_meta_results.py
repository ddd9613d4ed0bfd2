"""Meta results kept by what decides them (``meshfold.tracing.meta_results``): the layer record reuses each
pure op's result shapes across the layers of a stack, and records exactly what running every meta
kernel records."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshfold.tracing import layer_runs
from meshfold.tracing.fakes import fake_copies
from meshfold.tracing.meta_results import MetaResults
from tests.unit.test_solve_scale import _hf

aten = torch.ops.aten


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def test_a_call_made_again_returns_fresh_tensors_of_the_kernels_shapes() -> None:
    results = MetaResults()
    x = _meta(4, 8).t()  # NOTE: strides (1, 8): the result keeps the kernel's strides, not contiguous ones
    first = results.call(aten.mul.Tensor, (x, x), {})
    again = results.call(aten.mul.Tensor, (x, x), {})
    assert results.reused == 1
    assert again is not first and again.device.type == "meta"
    assert (again.shape, again.stride(), again.dtype) == (first.shape, first.stride(), first.dtype)
    a = results.call(aten.var_mean.correction, (_meta(3, 5),), {"dim": [1]})
    b = results.call(aten.var_mean.correction, (_meta(3, 5),), {"dim": [1]})
    assert isinstance(b, tuple) and [t.shape for t in b] == [t.shape for t in a] and results.reused == 2


@pytest.mark.parametrize(
    ("func", "args"),
    [
        (aten.add_.Tensor, lambda: (_meta(2, 3), _meta(2, 3))),  # writes its operand
        (aten.transpose.int, lambda: (_meta(2, 3), 0, 1)),  # a view of its operand
        (aten.mul.Tensor, lambda: (torch.empty(2, 3), torch.empty(2, 3))),  # off meta
    ],
    ids=["in-place", "view", "cpu"],
)
def test_ops_whose_results_are_not_fresh_meta_tensors_always_run(func: Any, args: Any) -> None:
    results = MetaResults()
    for _ in range(2):
        out = results.call(func, args(), {})
    assert results.reused == 0 and not results.seen
    assert isinstance(out, torch.Tensor)


def test_scalars_of_other_types_are_other_calls() -> None:
    # NOTE: 2 and 2.0 hash alike, but an integer tensor times 2.0 is a float tensor
    results = MetaResults()
    x = _meta(3, dtype=torch.int64)
    assert results.call(aten.mul.Tensor, (x, 2), {}).dtype == torch.int64
    assert results.call(aten.mul.Tensor, (x, 2.0), {}).dtype == torch.float32
    assert results.call(aten.mul.Tensor, (x, True), {}).dtype == torch.int64
    assert results.reused == 0


def test_the_record_of_a_real_model_is_the_record_of_every_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF Llama's layers recorded on meta: with the results reused, the same record op for op and
    the same runs as with every meta kernel run; most of the layers' ops were reused."""
    with torch.device("meta"):
        model = _hf("llama", 6)
    ids = torch.zeros(2, 32, dtype=torch.long)

    def record() -> layer_runs._Recorder:
        with fake_copies(model, (ids, ids)) as (_, fake):
            lists = layer_runs._lists(model)
            on_meta = [child for _, mod in lists for child in mod.children()]
            with layer_runs._apart(model, fake, on_meta) as (apart, meta):
                assert meta is not None
                return layer_runs._record(model, apart, lists, meta)

    reused = record()
    per_layer = len(reused.records[(0, 1)])
    assert reused.meta.reused >= 4 * per_layer // 2, (reused.meta.reused, per_layer)
    monkeypatch.setattr(MetaResults, "key", staticmethod(lambda *_: None))
    every = record()
    assert every.meta.reused == 0
    assert reused.records == every.records and reused.root_ops == every.root_ops
    lists = layer_runs._lists(model)
    assert layer_runs._runs(reused, lists) == layer_runs._runs(every, lists) != []


def test_a_factory_op_given_no_dtype_follows_the_default_dtype() -> None:
    results = MetaResults()
    args, kwargs = ([2], 1.0), {"device": torch.device("meta")}
    assert results.call(aten.full.default, args, kwargs).dtype == torch.float32
    was = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert results.call(aten.full.default, args, kwargs).dtype == torch.float64
    finally:
        torch.set_default_dtype(was)
    assert results.reused == 0


def test_what_has_no_schema_runs_as_it_is() -> None:
    # NOTE: a higher-order operator reaches a dispatch mode without an ATen schema
    results = MetaResults()
    calls = []
    for _ in range(2):
        results.call(lambda x: calls.append(x) or x, (_meta(2),), {})
    assert len(calls) == 2 and not results.seen
