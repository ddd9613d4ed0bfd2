"""Every ``tests/golden/<pass>/*.ir`` file: run its RUN pipeline, verify, filecheck the result."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.golden.harness import GOLDEN_DIR, filecheck, run_line, run_pipeline_file

CASES = sorted(p for p in GOLDEN_DIR.glob("*/*.ir") if p.parent.name != "zoo")


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_pass_golden(path: Path) -> None:
    filecheck(path, run_pipeline_file(path))


def test_there_are_golden_cases_for_every_registered_pass() -> None:
    from meshfold.passes import default_registry

    have = {p.parent.name for p in CASES}
    assert set(default_registry()) <= have, f"passes without golden tests: {set(default_registry()) - have}"


def test_a_run_line_is_a_command_a_user_can_type() -> None:
    """The RUN line runs as the installed ``pass-debug`` console script prints the same IR."""
    path = GOLDEN_DIR / "sharding" / "mlp-tp.ir"
    exe = shutil.which("pass-debug") or str(Path(sys.executable).parent / "pass-debug")
    argv = run_line(path)
    proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == run_pipeline_file(path)
    filecheck(path, proc.stdout)
