"""The model module path of an fx node, from the ``nn_module_stack`` dynamo records."""

from __future__ import annotations

import re

_MODULE_PATH_CLEANUPS = (
    (re.compile(r"getattr\((.*?), '([^']*)'\)"), r"\1.\2"),
    (re.compile(r"\._modules\['([^']*)'\]"), r".\1"),
    (re.compile(r"\['([^']*)'\]"), r".\1"),
    (re.compile(r"\[(\d+)\]"), r".\1"),
)


def module_path(raw: str) -> str:
    """``L['self'].layers[0]._modules['mlp']`` → ``layers.0.mlp``."""
    s = raw
    for _ in range(8):
        before = s
        for pat, rep in _MODULE_PATH_CLEANUPS:
            s = pat.sub(rep, s)
        if s == before:
            break
    s = re.sub(r"^L\.self\.?", "", s)
    s = re.sub(r"^_export_root\.?", "", s)
    return s.strip(".")
