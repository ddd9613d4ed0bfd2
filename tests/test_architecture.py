"""The structure DESIGN.md describes, checked: one import package, import direction, small files.

Import direction: tools → compiler → backends, passes → ir; ``ir`` imports nothing of ours. The
folders are mapped into the one package ``meshfold`` (compiler/ is ``meshfold`` itself).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("ir", "passes", "backends", "compiler", "tools")
SUBPACKAGES = {"ir", "passes", "backends", "tools"}
ALLOWED = {
    "ir": set(),
    "passes": {"ir"},
    "backends": {"ir", "passes"},
    "compiler": {"ir", "passes", "backends"},
    "tools": {"ir", "passes", "backends", "compiler"},
}
MAX_LINES = 400
# NOTE: files allowed past MAX_LINES, each with its reason; an entry that no longer applies fails too.
LONG_FILES: dict[str, str] = {
    "tools/bench/eager_vs_dtensor.py": "a benchmark script: the hand-written DTensor baseline and its timed runs",
}


def _folder(module: str, names: list[str]) -> set[str]:
    """The card folders a ``meshfold...`` import reaches (``from meshfold import ir`` reaches ir/)."""
    parts = module.split(".")
    if parts[0] != "meshfold":
        return set()
    if len(parts) > 1:
        return {parts[1] if parts[1] in SUBPACKAGES else "compiler"}
    return {n if n in SUBPACKAGES else "compiler" for n in names}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """The folders ``path`` imports from, and any old-style top-level imports of our folders."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    old: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found |= _folder(a.name, [])
                old |= {a.name.split(".")[0]} & set(FOLDERS)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= _folder(node.module, [a.name for a in node.names])
            old |= {node.module.split(".")[0]} & set(FOLDERS)
    return found, old


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction(package: str) -> None:
    bad = []
    for path in _sources(package):
        wrong = _imports(path)[0] - ALLOWED[package] - {package}
        if wrong:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not bad, "import direction broken:\n" + "\n".join(bad)


def test_everything_imports_meshfold_not_the_folders() -> None:
    """``import ir`` would work from the checkout but not for a user: only ``meshfold`` is installed."""
    bad = [
        f"{p.relative_to(ROOT)} imports {sorted(old)}"
        for p in sorted(ROOT.rglob("*.py"))
        if ".git" not in p.parts and (old := _imports(p)[1])
    ]
    assert not bad, "import these through meshfold (from meshfold import ir):\n" + "\n".join(bad)


def test_every_package_folder_is_in_the_distribution() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {name: folder for name, folder in project["package-dir"].items()}
    listed = set(project["packages"])
    want = set()
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(ROOT).parts
        if rel[0] not in FOLDERS:
            continue
        top = next(name for name, folder in mapped.items() if folder == rel[0])
        want.add(".".join((top, *rel[1:])))
    assert want == listed, f"pyproject's packages list differs: missing {want - listed}, extra {listed - want}"


def test_source_files_stay_small() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for f in FOLDERS for p in _sources(f)}
    big = [f"{name} ({n} lines)" for name, n in sorted(sizes.items()) if n > MAX_LINES and name not in LONG_FILES]
    assert not big, f"split these by responsibility (or name them in LONG_FILES with the reason): {big}"
    stale = [name for name in LONG_FILES if sizes.get(name, 0) <= MAX_LINES]
    assert not stale, f"these are no longer long; drop them from LONG_FILES: {stale}"


def test_sharding_rules_carry_no_backend_code() -> None:
    """Rules describe layouts; how a rank computes on its shard lives in backends/. (DTensor's strategy
    registries, which the fallback adapter reads, are layout descriptions too.)"""
    bad = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in _sources("passes/sharding/rules")
        for m in re.finditer(
            r"\b(localizer|ranged_impl|Ranged|_c10d_functional|funcol|distributed_c10d)\w*", p.read_text()
        )
    ]
    assert not bad, "backend code in sharding rules:\n" + "\n".join(bad)
