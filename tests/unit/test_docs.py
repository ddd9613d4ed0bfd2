"""The README and docs/ say what the repository holds: the README is the front page (short, its two
commands the ones CI runs), design.md's worked example runs, and every link and every repository
path or ``python -m`` module the pages name exists."""

from __future__ import annotations

import contextlib
import io
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GENERATED = {DOCS / "corpus.md"}
"""Pages written by a tool (``meshfold corpus --markdown docs/corpus.md``): their links are checked,
not the paths they name."""
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MAX_README_LINES = 150

_FENCE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\n]+)`")
_TOP = ("compiler/", "ir/", "passes/", "backends/", "tools/", "tests/", "docs/", ".ci/")
_MODULE = re.compile(r"python -m (meshfold(?:\.\w+)*)")


def _fenced_blocks(text: str, lang: str | None = None) -> list[str]:
    """The bodies of the fenced blocks of ``text`` in order (only those opened as ```lang)."""
    blocks = []
    for m in _FENCE.finditer(text):
        head, _, rest = m.group(0).partition("\n")
        if lang is None or head.strip() == f"```{lang}":
            blocks.append(rest.rsplit("```", 1)[0])
    return blocks


def _prose(text: str) -> str:
    """``text`` without its fenced blocks (whose ``#`` lines are comments, not headings)."""
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m is None:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _commands(block: str) -> list[str]:
    return [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _module_file(module: str) -> Path | None:
    """Where ``module`` (``meshfold.tools.bench.sim.plan_speed``) lives, by pyproject's package-dir."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in dirs:
            base = ROOT / dirs[prefix] / Path(*parts[n:]) if parts[n:] else ROOT / dirs[prefix]
            for candidate in (base.with_suffix(".py"), base / "__init__.py", base / "__main__.py"):
                if candidate.is_file():
                    return candidate
            return None
    return None


def test_readme_is_the_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move guides into docs/"


def test_readme_starts_with_the_commands_ci_runs() -> None:
    """The first two commands: the main job, then the tests exactly as ``.ci/run`` runs them."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    installs = [re.sub(r"\s-q\b", "", line) for line in ci if line.startswith("python -m pip install")]
    tests = [line for line in ci if line.startswith("python -m pytest")]
    assert installs and len(tests) == 1, ".ci/run no longer installs and runs pytest as expected"
    commands = [c for block in _fenced_blocks(README.read_text()) for c in _commands(block)]
    assert len(commands) >= 2
    assert commands[0] == " && ".join([*installs, "meshfold demo"])
    assert commands[1] == " && ".join([*installs, tests[0]])


def _design_example() -> str:
    text = (DOCS / "design.md").read_text()
    heading = "### A worked example: a pass of your own"
    assert heading in text, "design.md lost its worked example"
    blocks = _fenced_blocks(text.split(heading, 1)[1], "python")
    assert blocks, "design.md's worked example has no python block"
    return blocks[0]


def test_design_worked_example_runs() -> None:
    from meshfold.passes import default_registry

    namespace: dict[str, object] = {"__name__": "design_example"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # NOTE: dont_inherit: the block runs as a user's script would, without this file's __future__ imports
        exec(compile(_design_example(), str(DOCS / "design.md"), "exec", dont_inherit=True), namespace)
    printed = out.getvalue().splitlines()
    assert printed[0] == "cleanup,count-ops{top=1},verify"
    assert printed[1] == "{'aten.mm': 2} ['@tiny: 5 ops']"
    assert printed[2].startswith("unknown pass 'count-opz'; known passes:")
    assert "count-ops" in printed[2].split("known passes:", 1)[1].split(", ")
    reg = namespace["reg"]
    assert isinstance(reg, dict) and "count-ops" in reg
    assert "count-ops" not in default_registry(), "the example's registry leaked into the default one"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    bad = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            bad.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            bad.append(f"{target}: no heading #{anchor} in {where.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", [p for p in PAGES if p not in GENERATED], ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_and_modules_exist(page: Path) -> None:
    """Every ``compiler/...``, ``passes/...``, ``tools/...`` (...) path in backticks, and every
    ``python -m meshfold...`` module anywhere on the page."""
    text = page.read_text()
    bad = []
    for span in _CODE.findall(_prose(text)):
        for token in span.split():
            token = token.strip("\"'(),;:")
            if not token.startswith(_TOP):
                continue
            # NOTE: a placeholder (`tests/golden/<pass>/`, `rank{R}`) is checked up to where it starts
            path = re.split(r"[<{*]", token, maxsplit=1)[0]
            if not (ROOT / path).exists():
                bad.append(f"`{token}`: no such path")
    for module in _MODULE.findall(text):
        if _module_file(module) is None:
            bad.append(f"python -m {module}: no such module")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_pages_checked_are_all_there() -> None:
    """The guides the README's table links to, and the design page, exist (a page dropped from
    docs/ would otherwise only show up as a broken link)."""
    links = {t.partition("#")[0] for t in _LINK.findall(README.read_text()) if t.startswith("docs/")}
    assert {"docs/design.md", "docs/benchmarks.md"} <= links
    assert all((ROOT / link).is_file() for link in links)
