"""Every ``tests/golden/<pass>/*.ir`` file: run its RUN pipeline, verify, filecheck the result."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.golden.harness import GOLDEN_DIR, filecheck, run_pipeline_file

CASES = sorted(p for p in GOLDEN_DIR.glob("*/*.ir") if p.parent.name != "zoo")


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_pass_golden(path: Path) -> None:
    filecheck(path, run_pipeline_file(path))


def test_there_are_golden_cases_for_every_registered_pass() -> None:
    from meshfold.passes import default_registry

    have = {p.parent.name for p in CASES}
    assert set(default_registry()) <= have, f"passes without golden tests: {set(default_registry()) - have}"
