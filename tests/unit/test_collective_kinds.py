"""``tools.profiled_collectives.classify`` names every collective call the way the programs make it: the
functional ops of the eager programs and the in-place and ``out=`` forms Inductor's code calls."""

from __future__ import annotations

import pytest
import torch

from meshfold.tools.profiled_collectives import classify

c10d = torch.ops._c10d_functional


@pytest.mark.parametrize(
    ("func", "kind", "out_elems"),
    [
        (c10d.all_reduce.default, "all_reduce", 8),
        (c10d.all_reduce_.default, "all_reduce", 8),
        (c10d.all_gather_into_tensor_out.default, "all_gather", 16),
        (c10d.reduce_scatter_tensor_out.default, "reduce_scatter", 4),
    ],
)
def test_each_form_is_named_with_its_bytes(func: torch._ops.OpOverload, kind: str, out_elems: int) -> None:
    x = torch.zeros(8)
    result = torch.zeros(out_elems)
    assert classify(func, (x, "sum", "7"), result) == (kind, "7", 32, 4 * out_elems)


def test_a_wait_is_not_a_collective() -> None:
    x = torch.zeros(8)
    assert classify(c10d.wait_tensor.default, (x,), x) is None
