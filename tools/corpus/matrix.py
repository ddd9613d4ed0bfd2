"""The matrix: every corpus entry under every plan family on one pool of ranks, each cell against
the single-device model (``meshfold.tools.corpus.cell``), printed as a table with its counts.

A cell is ``equal``, ``refused`` (meshfold's own error, raised alike on every rank before any
collective of a program), ``FAIL`` (a value differed, or a rank crashed, died or hung), ``n/a``
(the family does not apply: expert parallelism on a dense model), or ``skipped`` (the entry's
modules are not installed).
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any

from meshfold.tools.corpus.plans import COLUMNS, WORLD, Column
from meshfold.tools.corpus.registry import Entry

STATUSES = ("equal", "refused", "FAIL", "n/a", "skipped")
MARKS = {"equal": "=", "refused": "R", "FAIL": "FAIL", "n/a": "·", "skipped": "-"}
TARGET = "meshfold.tools.corpus.cell:run"


@dataclass
class Cell:
    """One cell's outcome; ``message`` the refusal or the failure's first lines, ``log`` what the
    ranks printed and the whole failure (kept for ``FAIL`` only)."""

    entry: str
    column: str
    status: str
    message: str = ""
    seconds: float = 0.0
    log: str = ""

    @property
    def key(self) -> str:
        return f"{self.entry}:{self.column}"


def run_cell(
    pool: Any, entry: Entry, column: Column, *, steps: int = 3, verify: bool = False, timeout: float = 600.0
) -> Cell:
    """Run one cell on ``pool`` (``WORLD`` ranks) and classify it (see the module docstring)."""
    from meshfold.tools.pool import RankFailure

    if not column.applies(entry):
        return Cell(entry.name, column.name, "n/a")
    if not entry.available():
        return Cell(entry.name, column.name, "skipped", f"needs {', '.join(entry.requires)}")
    started = time.perf_counter()
    relayed = io.StringIO()
    try:
        with contextlib.redirect_stdout(relayed):
            results = pool.run(
                TARGET, timeout=timeout, entry=entry.name, column=column.name, steps=steps, verify=verify
            )
    except RankFailure as e:
        text = str(e)
        return Cell(entry.name, column.name, "FAIL", _gist(e), time.perf_counter() - started, relayed.getvalue() + text)
    seconds = time.perf_counter() - started
    statuses = {r["status"] for r in results}
    if statuses == {"equal"}:
        return Cell(entry.name, column.name, "equal", "", seconds)
    if statuses == {"refused"}:
        # NOTE: rank 0 compiled (the others name its error as theirs: "compilation failed on rank 0: ...")
        return Cell(entry.name, column.name, "refused", results[0]["message"], seconds)
    worst = next(r for r in results if r["status"] != "equal")
    message = worst["message"] if statuses <= {"equal", "differs"} else f"ranks disagree: {sorted(statuses)}"
    log = relayed.getvalue() + "\n".join(f"rank {i}: {r}" for i, r in enumerate(results))
    return Cell(entry.name, column.name, "FAIL", message, seconds, log)


def _gist(e: Exception) -> str:
    """The last line of the first failing rank's traceback (the exception), or why ranks stopped."""
    failures = getattr(e, "failures", {})
    for text in failures.values():
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        if lines:
            return lines[-1].strip()[:400]
    if getattr(e, "stuck", None):
        return f"hang: rank(s) {sorted(e.stuck)} did not finish"  # type: ignore[attr-defined]
    return str(e).splitlines()[0][:400]


def run_matrix(
    entries: Sequence[Entry],
    columns: Sequence[Column] = COLUMNS,
    *,
    steps: int = 3,
    verify: bool = False,
    timeout: float = 600.0,
    done: dict[str, Cell] | None = None,
    on_cell: Callable[[Cell], None] = lambda c: None,
) -> list[Cell]:
    """Every (entry, column) cell, row by row, on one pool of ``WORLD`` ranks; cells in ``done``
    (an earlier run's, by ``Cell.key``) are kept, not run again."""
    from meshfold.tools.pool import RankPool

    done = dict(done or {})
    out: list[Cell] = []
    pool: Any = None
    try:
        for entry in entries:
            for column in columns:
                key = f"{entry.name}:{column.name}"
                cell = done.get(key)
                if cell is None:
                    if pool is None and column.applies(entry) and entry.available():
                        pool = RankPool(WORLD, timeout=timeout)
                    cell = run_cell(pool, entry, column, steps=steps, verify=verify, timeout=timeout)
                    on_cell(cell)
                out.append(cell)
    finally:
        if pool is not None:
            pool.close()
    return out


def counts(cells: Iterable[Cell]) -> Counter[str]:
    """Cells per status."""
    return Counter(c.status for c in cells)


def summary(cells: Sequence[Cell]) -> str:
    """``N cells: a equal, b refused (x%), c FAIL`` over the cells that ran (not n/a or skipped)."""
    n = counts(cells)
    ran = n["equal"] + n["refused"] + n["FAIL"]
    share = 100.0 * n["refused"] / ran if ran else 0.0
    extra = ", ".join(f"{n[s]} {s}" for s in ("n/a", "skipped") if n[s])
    return f"{ran} cells: {n['equal']} equal, {n['refused']} refused ({share:.1f}%), {n['FAIL']} FAIL" + (
        f" ({extra})" if extra else ""
    )


def rich_table(cells: Sequence[Cell], entries: Sequence[Entry], columns: Sequence[Column]) -> Any:
    """The matrix as a ``rich`` table: a row per entry, a column per plan family's column."""
    from rich.table import Table

    style = {"equal": "green", "refused": "yellow", "FAIL": "bold red", "n/a": "dim", "skipped": "dim"}
    by = {c.key: c for c in cells}
    table = Table(title="meshfold corpus: each cell against one device", show_lines=False)
    table.add_column("entry", no_wrap=True)
    for col in columns:
        table.add_column(col.name, justify="center")
    for e in entries:
        row = [e.name]
        for col in columns:
            c = by.get(f"{e.name}:{col.name}")
            row.append("" if c is None else f"[{style[c.status]}]{MARKS[c.status]}[/]")
        table.add_row(*row)
    return table


def markdown(cells: Sequence[Cell], entries: Sequence[Entry], columns: Sequence[Column]) -> str:
    """The matrix as a markdown page: the date, the commit, the counts, the table, then every
    refusal and failure with its message."""
    by = {c.key: c for c in cells}
    lines = [
        "# The differential corpus",
        "",
        f"Run on {date.today().isoformat()} at commit `{_commit()}` on {WORLD} gloo ranks "
        "(`meshfold corpus --markdown docs/corpus.md`). Each cell trains the entry under the column's plan "
        "for three AdamW steps beside the same model on one device, comparing the loss and every gradient "
        "after each backward and the parameters after the last step.",
        "",
        f"**{summary(cells)}.** `=` equal, `R` refused before any collective, `FAIL` differs, crashed "
        "or hung, `·` the family does not apply, `-` the entry's modules are not installed.",
        "",
        "| entry | kind | source | " + " | ".join(c.name for c in columns) + " |",
        "|---|---|---|" + "|".join(":-:" for _ in columns) + "|",
    ]
    for e in entries:
        marks = [MARKS[by[k].status] if (k := f"{e.name}:{c.name}") in by else "" for c in columns]
        lines.append(f"| {e.name} | {e.kind} | {e.source} | " + " | ".join(marks) + " |")
    lines += ["", "## Columns", ""]
    for c in columns:
        opts = ", ".join(f"{k}={v!r}" for k, v in c.kwargs().items() if k != "plan")
        needs = f"; only entries with {', '.join(sorted(c.needs))}" if c.needs else ""
        lines.append(f"- `{c.name}`: mesh `{c.mesh}`, plan `{c.plan}`{', ' + opts if opts else ''}{needs}")
    notes = [c for c in cells if c.status in ("refused", "FAIL")]
    if notes:
        lines += ["", "## Refusals and failures", ""]
        for c in notes:
            lines.append(f"- **{c.entry} / {c.column}** ({c.status}): {c.message.splitlines()[0] if c.message else ''}")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def save(cells: Sequence[Cell], path: Path) -> None:
    """Write ``cells`` as JSON (``load`` reads them back to resume a run)."""
    path.write_text(json.dumps([asdict(c) for c in cells], indent=1))


def load(path: Path) -> dict[str, Cell]:
    """Cells an earlier ``save`` wrote, by key; none when the file does not exist."""
    if not path.exists():
        return {}
    data: list[dict[str, Any]] = json.loads(path.read_text())
    return {c.key: c for c in (Cell(**d) for d in data)}
