"""Golden-file machinery: filecheck'd pass tests and whole expected dumps.

``MESHFOLD_UPDATE_GOLDEN=1`` rewrites expected files from what the code prints now; a changed
golden file is reviewed like code. A ``// RUN:`` line names the pipeline, then optional
``--mesh dp=2,tp=2``, ``--assume boxed`` and ``--moe ep=4`` (the expert mapping for the graph's
``meshfold.moe_experts`` weights, as ``pass-debug --moe`` gives it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from meshfold import ir
from meshfold.moe import plan_with_experts
from meshfold.passes import JOINT, PassContext, PassPipeline
from meshfold.passes.sharding.plans import Plan
from meshfold.tools.pass_debug import parse_moe, sharding_preset

GOLDEN_DIR = Path(__file__).parent
UPDATE = os.environ.get("MESHFOLD_UPDATE_GOLDEN") == "1"


def run_line(path: Path) -> tuple[str, ir.Mesh | None, frozenset[str], str | None]:
    """The pipeline, ``--mesh``, ``--assume`` (graph properties taken as given) and ``--moe`` of the
    ``// RUN:`` line."""
    for line in path.read_text().splitlines():
        if line.startswith("// RUN:"):
            words = line[len("// RUN:") :].split()
            opts = dict(zip(words[1::2], words[2::2], strict=False))
            mesh = opts.get("--mesh")
            assume = frozenset(filter(None, opts.get("--assume", "").split(",")))
            return words[0], ir.Mesh.parse(mesh) if mesh else None, assume, opts.get("--moe")
    raise AssertionError(f"{path} has no `// RUN: <pipeline>` line")


def run_pipeline_file(path: Path) -> str:
    """Parse the file's IR, run its RUN pipeline verifying after every pass, return the printed result."""
    pipeline, mesh, assume, moe = run_line(path)
    graph = ir.parse(path.read_text())
    ir.verify(graph)
    ctx = PassContext(mesh=mesh)
    if moe is not None:
        assert mesh is not None, f"{path}: --moe needs --mesh"
        passes = PassPipeline.parse(pipeline)
        plan = Plan.of(sharding_preset(passes, mesh))
        ctx = PassContext(mesh=mesh, plan=plan_with_experts(plan, parse_moe(moe), graph, mesh))

    def check(i: int, p: object, g: ir.Graph) -> None:
        ir.verify(g)

    out, _ = PassPipeline.parse(pipeline).run(ctx, graph, check, initial=assume | {JOINT})
    return str(out)


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
