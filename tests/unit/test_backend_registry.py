"""The backend registry (``backends/select.py``): every backend one registered class, found by name."""

from __future__ import annotations

from typing import Any, cast

import pytest

from meshfold.backends import backend_names, get_backend
from meshfold.backends.select import Backend, select
from meshfold.passes.base import PassError


def test_the_registered_backends() -> None:
    assert backend_names() == ("eager", "inductor", "ascend", "onnx")
    assert backend_names(training_only=True) == ("eager", "inductor", "ascend")
    for name in backend_names():
        b = get_backend(name)
        assert isinstance(b, Backend) and b.name == name and b.description


def test_an_unknown_backend_names_the_available_ones() -> None:
    with pytest.raises(PassError, match="backend 'tpu' is not available; backends: eager, inductor, ascend, onnx"):
        get_backend("tpu")


def test_eager_runs_the_lowered_modules_as_they_are() -> None:
    lowered = cast(Any, object())
    assert select("eager", cast(Any, None), lowered, cast(Any, None), "cpu", "rank 0") is lowered


def test_onnx_is_export_only() -> None:
    with pytest.raises(PassError, match="export-onnx"):
        get_backend("onnx").run(cast(Any, None), cast(Any, None), cast(Any, None), "cpu", "rank 0")
