"""Every op our dialects define comes as a bundle of four: an IR definition, a sharding rule, a
local lowering and a cost, each looked up in the registry that uses it.

* IR definition: a ``meshfold::`` custom op with a fake kernel, defined by a module of
  ``ir.dialects.DIALECTS`` and resolved by name as IR text names it (``ir.ops.resolve_target``);
* sharding rule: ``passes.sharding.rules.rule_table()``;
* local lowering: an entry of its own in the lowering table (``backends/lowering/lowerings.py``)
  or a ranged form (``backends/local.py``), not just the default for ATen ops;
* cost: a FLOPs formula (``passes.sharding.opwork.OWN_FLOPS``) or a declaration that bytes alone
  price it (``MEMORY_BOUND``).

``NOT_APPLICABLE`` names each (op, part) that genuinely does not apply, with the reason; an entry
that no longer applies (the op now has that part, or is gone) fails too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch._library.simple_registry import singleton

from meshfold.backends.local import LOCAL
from meshfold.backends.lowering.lowerings import LOWERINGS
from meshfold.ir import Target, ops
from meshfold.ir.dialects import DIALECTS
from meshfold.passes.sharding.opwork import MEMORY_BOUND, OWN_FLOPS
from meshfold.passes.sharding.rules import rule_table

DIALECT_DIR = Path(__file__).resolve().parents[2] / "ir" / "dialects"
DEFINED = re.compile(r'custom_op\(\s*"meshfold::(\w+)"')
PARTS = ("ir", "rule", "lowering", "cost")

NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("stage_in", "cost"): "an identity mark of a pipeline stage boundary: it computes nothing, so it has no "
    "FLOPs formula (the time model charges its bytes as for any op without one)",
    ("stage_in_grad", "cost"): "the identity mark's gradient, as stage_in",
}


def _defined() -> dict[str, str]:
    """Every ``meshfold::`` op a dialect file defines, by name, with the defining module's name."""
    out: dict[str, str] = {}
    for path in sorted(DIALECT_DIR.glob("*.py")):
        for name in DEFINED.findall(path.read_text()):
            out[name] = f"meshfold.ir.dialects.{path.stem}"
    return out


DEFINED_OPS = _defined()


def _target(name: str) -> Target:
    return ops.resolve_target(f"meshfold.{name}")


def _has(name: str, part: str) -> bool:
    if part == "ir":
        entry = singleton.find(f"meshfold::{name}")
        return isinstance(_target(name), torch._ops.OpOverload) and entry.fake_impl.kernel is not None
    target = _target(name)
    if part == "rule":
        return rule_table().get(target) is not None
    if part == "lowering":
        return target in LOWERINGS.targets or target in LOCAL.ranged
    return target in OWN_FLOPS or target in MEMORY_BOUND


def test_the_dialects_define_our_ops() -> None:
    assert {"moe_experts", "ring_step", "affine_scan", "causal_conv1d", "constant", "stage_in"} <= set(DEFINED_OPS)
    registered = {m.__name__ for m in DIALECTS}
    stray = {n: m for n, m in DEFINED_OPS.items() if m not in registered}
    assert not stray, f"ops defined by modules missing from ir.dialects.DIALECTS: {stray}"


@pytest.mark.parametrize("name", sorted(DEFINED_OPS))
def test_every_op_has_its_bundle(name: str) -> None:
    missing = [p for p in PARTS if (name, p) not in NOT_APPLICABLE and not _has(name, p)]
    assert not missing, f"meshfold.{name} ({DEFINED_OPS[name]}) has no {', '.join(missing)}"


def test_not_applicable_entries_are_current() -> None:
    stale = [key for key in NOT_APPLICABLE if key[0] not in DEFINED_OPS or _has(*key)]
    assert not stale, f"these ops now have the part, or are gone; drop them from NOT_APPLICABLE: {stale}"
