"""The structure docs/design.md describes, checked: one import package, rooms that import downward
only, no import cycle between modules, one name per module, a bounded number of modules per folder.

The rooms, lowest first (a room imports only rooms below it): ``target`` (the hardware catalog) and
``ir``; ``passes``; ``sim`` (the cluster simulator) and ``backends``; then the front door's jobs,
``rewrites`` (the capture passes over dynamo's graph) → ``tracing`` (capture, which runs them) → ``runtime`` →
``pp`` (pipeline parallelism) → the front door itself (``meshfold``: api, session, packing); and
``tools`` on top. compiler/ is the package ``meshfold`` itself; the other card folders are mapped
into it.
"""

from __future__ import annotations

import ast
import tomllib
from collections import Counter
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("ir", "passes", "backends", "compiler", "tools")
# NOTE: each room and the rooms it may import; a room not named here is the front door's top level
BELOW: dict[str, set[str]] = {
    "target": set(),
    "ir": set(),
    "passes": {"ir", "target"},
    "sim": {"target", "passes"},
    "backends": {"ir", "passes", "target"},
    "rewrites": {"ir", "passes", "target", "backends"},
    "tracing": {"ir", "passes", "target", "backends", "rewrites"},
    "runtime": {"ir", "passes", "target", "backends", "tracing", "rewrites"},
    "pp": {"ir", "passes", "target", "backends", "tracing", "rewrites", "runtime"},
    "meshfold": {"ir", "passes", "target", "sim", "backends", "tracing", "rewrites", "runtime", "pp"},
}
BELOW["tools"] = set(BELOW) - {"tools"} | {"meshfold"}
MAX_MODULES = 15
"""Modules per folder, ``__init__`` aside: a folder past this has found a sub-concept."""
SOFT_LINES = 500
"""Past this a module is reported (a warning, not a failure): files end where a concept ends."""
# NOTE: cycles kept on purpose, each with its reason; an entry that no longer applies fails too.
CYCLES: dict[frozenset[str], str] = {
    frozenset(
        {"meshfold.ir.graph", "meshfold.ir.printer"}
    ): "str(graph) prints through the printer, which reads graphs",
}
# NOTE: upward imports kept for now, each with its reason; an entry that no longer applies fails too.
UPWARD: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out: dict[str, Path] = {}
    for name, folder in mapped.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if name == "meshfold" and parts and parts[0] in FOLDERS:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([name, *parts])] = path
    return out


MODULES = _modules()


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in BELOW else "meshfold"


def _resolve(name: str) -> str | None:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (annotations: they never run)."""
    return {
        id(m)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
        for m in ast.walk(n)
    }


def _graph() -> nx.DiGraph:
    """Module → module it imports (at the top or inside a function alike), as written in the code."""
    g = nx.DiGraph()
    for name, path in MODULES.items():
        g.add_node(name)
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_only(tree)
        for n in ast.walk(tree):
            targets: list[str | None] = []
            if id(n) in skip:
                continue
            if isinstance(n, ast.Import):
                targets = [_resolve(a.name) for a in n.names if a.name.startswith("meshfold")]
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.startswith("meshfold"):
                targets = [_resolve(f"{n.module}.{a.name}") for a in n.names]
            g.add_edges_from((name, t) for t in targets if t is not None and t != name)
    return g


GRAPH = _graph()


def test_rooms_import_downward_only() -> None:
    bad = [
        f"{a} imports {b} ({room(a)} may import {sorted(BELOW[room(a)]) or 'nothing of ours'})"
        for a, b in sorted(GRAPH.edges)
        if room(a) != room(b) and room(b) not in BELOW[room(a)] and (room(a), room(b)) not in UPWARD
    ]
    assert not bad, "upward imports:\n" + "\n".join(bad)
    used = {(room(a), room(b)) for a, b in GRAPH.edges}
    stale = [pair for pair in UPWARD if pair not in used]
    assert not stale, f"these upward imports are gone; drop them from UPWARD: {stale}"


def test_no_import_cycle_between_modules() -> None:
    found = {frozenset(c) for c in nx.strongly_connected_components(GRAPH) if len(c) > 1}
    bad = sorted(sorted(c) for c in found - set(CYCLES))
    assert not bad, "import cycles (move what both need into a module below them):\n" + "\n".join(map(str, bad))
    stale = [sorted(c) for c in CYCLES if c not in found]
    assert not stale, f"these cycles are gone; drop them from CYCLES: {stale}"


def test_module_names_are_unique() -> None:
    names = Counter(p.stem for p in MODULES.values() if p.stem != "__init__")
    twice = {
        n: sorted(str(p.relative_to(ROOT)) for p in MODULES.values() if p.stem == n) for n, k in names.items() if k > 1
    }
    assert not twice, f"two modules with one name: {twice}"


def test_folders_hold_a_bounded_number_of_modules() -> None:
    per = Counter(p.parent for p in MODULES.values() if p.stem != "__init__")
    big = {str(d.relative_to(ROOT)): k for d, k in per.items() if k > MAX_MODULES}
    assert not big, f"folders past {MAX_MODULES} modules (find the sub-concept and give it a folder): {big}"


def test_long_modules_are_reported(recwarn: pytest.WarningsRecorder) -> None:
    """Not a split rule: a module past SOFT_LINES is named, so a reader can ask whether it is one concept."""
    import warnings

    for path in sorted(MODULES.values()):
        if (n := len(path.read_text().splitlines())) > SOFT_LINES:
            warnings.warn(f"{path.relative_to(ROOT)} has {n} lines", stacklevel=1)
    assert all(str(w.message).endswith("lines") for w in recwarn)


def test_everything_imports_meshfold_not_the_folders() -> None:
    """``import ir`` would work from the checkout but not for a user: only ``meshfold`` is installed."""
    bad = []
    for p in sorted(ROOT.rglob("*.py")):
        if ".git" in p.parts:
            continue
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            mods = [a.name for a in n.names] if isinstance(n, ast.Import) else []
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                mods = [n.module]
            bad += [f"{p.relative_to(ROOT)} imports {m}" for m in mods if m.split(".")[0] in FOLDERS]
    assert not bad, "import these through meshfold (from meshfold import ir):\n" + "\n".join(bad)


def test_every_package_folder_is_in_the_distribution() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    want = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert want == listed, f"pyproject's packages list differs: missing {want - listed}, extra {listed - want}"


def test_sharding_rules_carry_no_backend_code() -> None:
    """Rules describe layouts; how a rank computes on its shard lives in backends/. (DTensor's strategy
    registries, which the fallback adapter reads, are layout descriptions too.)"""
    import re

    bad = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in sorted((ROOT / "passes/sharding/rules").rglob("*.py"))
        for m in re.finditer(
            r"\b(localizer|ranged_impl|Ranged|_c10d_functional|funcol|distributed_c10d)\w*", p.read_text()
        )
    ]
    assert not bad, "backend code in sharding rules:\n" + "\n".join(bad)
