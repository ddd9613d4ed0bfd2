"""ruff and strict mypy run as part of the suite, so CI enforces them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    exe = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(exe).exists():
        pytest.skip(f"{name} is not installed (it comes with the `dev` extra)")
    return exe


def test_ruff_clean() -> None:
    proc = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_on_ir_and_passes(tmp_path: Path) -> None:
    """mypy reads packages from folders, so it sees ``meshfold`` as the installed layout: a tree of
    links built in ``tmp_path``. Of compiler/ only the package's ``__init__`` and the two pure-Python
    packages beneath the passes are there (``target``, the hardware catalog, and ``sim``, the
    cluster simulator): ir/ and passes/ never import the front door, so strictness stops at their
    border. The catalog and the simulator are checked as strictly."""
    package = tmp_path / "meshfold"
    package.mkdir()
    (package / "__init__.py").symlink_to(ROOT / "compiler" / "__init__.py")
    for folder in ("ir", "passes", "backends", "tools"):
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    for sub in ("target", "sim"):
        (package / sub).symlink_to(ROOT / "compiler" / sub, target_is_directory=True)
    config = ROOT / "pyproject.toml"
    cmd = [_tool("mypy"), "--config-file", str(config), str(package / "ir"), str(package / "passes")]
    cmd += [str(package / "target"), str(package / "sim")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
