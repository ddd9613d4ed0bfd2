"""Import direction (DESIGN.md): tools → compiler → backends, passes → ir; ``ir`` imports nothing of ours."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = {"ir", "passes", "compiler", "backends", "tools"}
ALLOWED = {
    "ir": set(),
    "passes": {"ir"},
    "backends": {"ir", "passes"},
    "compiler": {"ir", "passes", "backends"},
    "tools": {"ir", "passes", "backends", "compiler"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & OURS


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = _imports(path) - ALLOWED[package] - {package}
        if wrong:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not bad, "import direction broken:\n" + "\n".join(bad)


def test_source_files_stay_small() -> None:
    big = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for pkg in OURS
        for p in (ROOT / pkg).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    ]
    assert not big, f"split these by responsibility: {big}"
