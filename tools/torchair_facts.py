"""Regenerate ``backends/torchair_converters.txt``, the ops torchair's graph mode (GE) can take, from
a torchair checkout: ``python -m meshfold.tools.torchair_facts /path/to/torchair [--out FILE]``.

An op is listed when torchair registers a GE converter for it whose body does more than raise
``NotImplementedError`` (torchair registers a stub for most ATen ops and implements a subset), or when
torchair's default decompositions (``get_npu_default_decompositions``) rewrite it into such ops before
conversion. The file records the checkout's commit and date; the backend reads only the op names. The
sources are parsed, never imported or run.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

CONVERTERS = "python/torchair/_ge_concrete_graph/ge_converter"
DECOMPOSITIONS = "python/torchair/_utils/__init__.py"
DEFAULT = Path(__file__).resolve().parents[1] / "backends" / "torchair_converters.txt"


def _op_name(node: ast.expr) -> str | None:
    """``torch.ops.aten.addmm.default`` -> ``aten.addmm.default`` (None for anything else)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id != "torch" or parts[-1:] != ["ops"]:
        return None
    return ".".join(reversed(parts[:-1]))


def _stub(fn: ast.FunctionDef) -> bool:
    """Whether ``fn`` only raises ``NotImplementedError`` (after its docstring)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    target = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(target, ast.Name) and target.id == "NotImplementedError"


def converted(source: str) -> Iterator[tuple[str, bool]]:
    """(op, implemented) for every converter registered in one source file."""
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for deco in fn.decorator_list:
            if isinstance(deco, ast.Call) and getattr(deco.func, "id", "") == "register_fx_node_ge_converter":
                name = _op_name(deco.args[0]) if deco.args else None
                if name is not None:
                    yield name, not _stub(fn)


def decomposed(source: str) -> set[str]:
    """The ops ``get_npu_default_decompositions`` maps to a decomposition (its dict literals' keys)."""
    out: set[str] = set()
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef) and fn.name == "get_npu_default_decompositions":
            for node in ast.walk(fn):
                if isinstance(node, ast.Dict):
                    out |= {n for k in node.keys if k is not None and (n := _op_name(k)) is not None}
    return out


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def facts(repo: Path) -> tuple[str, list[str], dict[str, int]]:
    """(header, sorted op names, counts) from the torchair checkout (or bare mirror) at ``repo``."""
    commit, date = _git(repo, "log", "-1", "--format=%H %cs").split()
    files = [f for f in _git(repo, "ls-tree", "-r", "--name-only", "HEAD", CONVERTERS).split() if f.endswith(".py")]
    implemented: set[str] = set()
    stubs = 0
    for f in files:
        for name, real in converted(_git(repo, "show", f"HEAD:{f}")):
            if real:
                implemented.add(name)
            else:
                stubs += 1
    decomp = decomposed(_git(repo, "show", f"HEAD:{DECOMPOSITIONS}"))
    ops = sorted(implemented | decomp)
    header = (
        f"# torchair graph-mode (GE) converters: Ascend/torchair {commit} ({date})\n"
        f"# {len(implemented)} ops with a converter that converts, {len(decomp)} decomposed first by torchair's "
        f"defaults; {stubs} registered stubs (raise NotImplementedError) left out\n"
        "# regenerate: python -m meshfold.tools.torchair_facts /path/to/torchair\n"
    )
    return header, ops, {"implemented": len(implemented), "decomposed": len(decomp), "stubs": stubs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", type=Path, help="a torchair checkout or git mirror")
    ap.add_argument("--out", type=Path, default=DEFAULT)
    args = ap.parse_args(argv)
    header, ops, counts = facts(args.repo)
    args.out.write_text(header + "".join(f"{op}\n" for op in ops))
    print(f"{args.out}: {len(ops)} ops ({counts})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
