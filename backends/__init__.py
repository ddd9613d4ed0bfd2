"""Backends lower each rank's IR program to runnable ``torch.fx`` graphs through one lowering table
(``backends/lowering/``) and run them as a registered backend (``backends/select.py``: eager,
Inductor, torchair; ONNX export only).

``backend_names``, ``get_backend`` and ``Backend`` load from ``backends/select.py`` on first use, so
importing one backend module does not import the registry.
"""

from __future__ import annotations

import importlib
from typing import Any

_FROM_SELECT = ("Backend", "backend_names", "get_backend")


def __getattr__(name: str) -> Any:
    if name in _FROM_SELECT:
        return getattr(importlib.import_module("meshfold.backends.select"), name)
    raise AttributeError(f"module 'meshfold.backends' has no attribute {name!r}")


__all__ = list(_FROM_SELECT)
