"""Golden-file machinery: filecheck'd pass tests and whole expected dumps.

``MESHFOLD_UPDATE_GOLDEN=1`` rewrites expected files from what the code prints now; a changed
golden file is reviewed like code. A pass test's ``// RUN:`` line is a real ``pass-debug`` command
(``%s`` is the file itself), as a user would type it; its standard output is filecheck'd.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from meshfold.tools.pass_debug import main as pass_debug

GOLDEN_DIR = Path(__file__).parent
UPDATE = os.environ.get("MESHFOLD_UPDATE_GOLDEN") == "1"


def run_line(path: Path) -> list[str]:
    """The ``// RUN:`` command of ``path`` as argv, ``%s`` replaced by the file's path."""
    for line in path.read_text().splitlines():
        if line.startswith("// RUN:"):
            words = shlex.split(line[len("// RUN:") :])
            assert words and words[0] == "pass-debug", f"{path}: a RUN line runs pass-debug, not {words[:1]}"
            return [str(path) if w == "%s" else w for w in words]
    raise AssertionError(f"{path} has no `// RUN: pass-debug %s ...` line")


def run_pipeline_file(path: Path) -> str:
    """Run the file's RUN command (pass-debug's entry point, in this process) and return its stdout."""
    argv = run_line(path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = pass_debug(argv[1:])
    assert code == 0, f"{shlex.join(argv)} exited {code}:\n{err.getvalue()}"
    return out.getvalue()


def filecheck(path: Path, output: str) -> None:
    """Check ``output`` against the ``// CHECK`` lines of ``path`` (or rewrite them when updating)."""
    if UPDATE:
        kept = [ln for ln in path.read_text().splitlines() if not ln.startswith("// CHECK")]
        lines = output.rstrip("\n").splitlines()
        checks = [f"// CHECK: {lines[0]}"] + [
            f"// CHECK-NEXT: {ln}" if ln.strip() else "// CHECK-EMPTY:" for ln in lines[1:]
        ]
        path.write_text("\n".join(kept + checks) + "\n")
        return
    exe = shutil.which("filecheck") or str(Path(sys.executable).parent / "filecheck")
    proc = subprocess.run([exe, str(path)], input=output, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"filecheck failed for {path.name}:\n{proc.stderr}\n--- output ---\n{output}"


def expect_text(path: Path, actual: str) -> None:
    """Whole-dump golden: ``actual`` must equal the file (rewritten when updating)."""
    if UPDATE or not path.exists():
        if not UPDATE:
            raise AssertionError(f"{path} is missing; run with MESHFOLD_UPDATE_GOLDEN=1 to create it")
        path.write_text(actual)
        return
    expected = path.read_text()
    if expected != actual:
        import difflib

        diff = "".join(
            difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), "expected", "actual", n=2)
        )
        raise AssertionError(
            f"{path.name} differs from the golden file (MESHFOLD_UPDATE_GOLDEN=1 rewrites it):\n{diff[:6000]}"
        )
