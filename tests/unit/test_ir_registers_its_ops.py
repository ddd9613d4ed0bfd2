"""Importing ``meshfold.ir`` alone registers every custom op the IR defines, so IR text that names
one (a pass-debug dump, a golden file) parses in a fresh interpreter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFINED = re.compile(r'custom_op\(\s*"meshfold::(\w+)"')


def _ir_ops() -> list[str]:
    return sorted({m for f in (ROOT / "ir").rglob("*.py") for m in DEFINED.findall(f.read_text())})


def test_every_op_the_ir_defines_resolves_after_importing_the_ir_alone() -> None:
    names = _ir_ops()
    assert {"ring_step", "stage_in", "affine_scan", "moe_experts"} <= set(names), names
    code = (
        # NOTE: the parser resolves an op's name with resolve_target
        "import sys\nfrom meshfold.ir import ops\n"
        f"for n in {names!r}: ops.resolve_target('meshfold.' + n)\n"
        "assert 'meshfold.tracing.tracer' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
