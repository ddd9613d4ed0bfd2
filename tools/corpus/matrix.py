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

from meshfold.tools.corpus.catalog import Entry
from meshfold.tools.corpus.columns import COLUMNS, WORLD, Column

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
        # NOTE: the message names the near ties the single-device steps resolved the other way, if any
        return Cell(entry.name, column.name, "equal", results[0]["message"], seconds)
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
    odd = sum(1 for c in cells if c.status == "refused" and limitation(c) is None)
    undocumented = f" ({odd} no limitation documents)" if odd else ""
    return f"{ran} cells: {n['equal']} equal, {n['refused']} refused ({share:.1f}%){undocumented}, {n['FAIL']} FAIL" + (
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


@dataclass(frozen=True)
class Limitation:
    """A plan a kind of model truly cannot run equal to one device: the cells whose refusal message
    holds ``phrase`` are this one, documented with ``why`` and what to do instead."""

    phrase: str
    title: str
    why: str


LIMITATIONS: tuple[Limitation, ...] = (
    Limitation(
        "draws random numbers",
        "Dropout under a pipeline",
        "each microbatch would draw its own mask from the generator, so no pipelined step draws the "
        "single-device model's masks over the whole batch; train pipelined with dropout off (p=0), which "
        "large-model pretraining does, or use a plan without pp",
    ),
    Limitation(
        "updates buffers in place",
        "Running statistics under a pipeline",
        "BatchNorm (and torchtitan's MoE token counters) normalise by, and update their buffers from, the "
        "batch they see: a microbatch's statistics are not the batch's. Use a plan without pp, or GroupNorm",
    ),
    Limitation(
        "split neither by batch nor by heads",
        "Ulysses where the decoder's input is made from the labels",
        "BART and Marian build their decoder's input by shifting the labels one place along the sequence "
        "(new_zeros, then slice_scatter): the solve keeps that whole, so Ulysses would give every rank the "
        "whole sequence to attend over, and meshfold says so rather than run the attention unsplit; ring "
        "attention (cp={'method': 'ring'}) trains them",
    ),
    Limitation(
        "has no MoE layer meshfold can fold",
        "Expert parallelism on experts meshfold does not recognise",
        "torchtitan's DeepSeek-V3 runs its experts as one grouped matmul over tokens sorted by expert "
        "(torch._grouped_mm with per-expert counts), a form meshfold's MoE folding does not read; moe= "
        "refuses it naming the reason. Every other plan trains it; writing the experts as one call of "
        "meshfold.moe_experts gives them expert parallelism",
    ),
    Limitation(
        "only the hidden states a layer",
        "A value shared by every layer, made by the first",
        "T5 computes its relative position bias in its first block and hands it to every later one: under a "
        "pipeline that value would cross every stage boundary beside the hidden states. Use a plan without "
        "pp for such models",
    ),
)


TIES_NOTE = (
    "A top-k router is discontinuous: where a token's k-th and (k+1)-th scores lie within the rounding "
    "of what the model computes in, a correct plan may pick the other expert. In these cells a step "
    "differed, and the program then equalled the single-device step run with the named ties resolved "
    "the other way (every loss and gradient within the usual tolerances; the single-device model "
    "trained on from that run). No other difference is explained this way."
)


def limitation(cell: Cell) -> Limitation | None:
    """The documented limitation a refused cell is, if any."""
    return next((lim for lim in LIMITATIONS if lim.phrase in cell.message), None)


def markdown(cells: Sequence[Cell], entries: Sequence[Entry], columns: Sequence[Column]) -> str:
    """The matrix as a markdown page: the date, the commit, the counts, the table, the entries and
    columns, every refusal under the documented limitation it is (or listed as undocumented), and
    every failure with its message."""
    by = {c.key: c for c in cells}
    lines = [
        "# The differential corpus",
        "",
        f"Run on {date.today().isoformat()} at commit `{_commit()}` on {WORLD} gloo ranks "
        "(`meshfold corpus --markdown docs/corpus.md`; `meshfold corpus --cell ENTRY:COLUMN` reruns one cell "
        "and prints its ranks' logs). Each cell compiles the entry under the column's plan and trains it for "
        "three AdamW steps beside the same model on one device: after every backward the loss (relative "
        "1e-5) and every gradient (its largest difference at most 1e-4 of its own largest entry, or of "
        "1e-4 of the model's largest gradient where that is larger: a gradient that is zero in exact "
        "arithmetic holds float noise), and the parameters after the last step (within 5% of one step). An "
        "entry whose own code computes in bf16 is held to bf16's rounding (2e-3, 2e-2, a quarter step). A "
        "step that differs where the single-device router chose between two experts whose scores nearly tie "
        "is compared again with such ties resolved the other way on one device (see the section on near "
        "ties below, where any cell needed it).",
        "",
        f"**{summary(cells)}.** `=` equal, `R` refused on every rank before any collective of a program, "
        "`FAIL` a value differed or a rank crashed or hung, `·` the family does not apply to the entry "
        "(context parallelism without attention, expert parallelism without experts, pipelines without a "
        "layer stack), `-` the entry's modules are not installed.",
        "",
        "| entry | kind | " + " | ".join(c.name for c in columns) + " |",
        "|---|---|" + "|".join(":-:" for _ in columns) + "|",
    ]
    for e in entries:
        marks = [MARKS[by[k].status] if (k := f"{e.name}:{c.name}") in by else "" for c in columns]
        lines.append(f"| {e.name} | {e.kind} | " + " | ".join(marks) + " |")
    lines += ["", "## Entries", ""]
    lines += [f"- `{e.name}` ({e.kind}, {e.source}): {e.note}" for e in entries]
    lines += ["", "## Columns", ""]
    for c in columns:
        opts = ", ".join(f"{k}={v!r}" for k, v in c.kwargs().items() if k != "plan")
        needs = f"; entries with {', '.join(sorted(c.needs))}" if c.needs else ""
        lines.append(f"- `{c.name}`: mesh `{c.mesh}`, plan `{c.plan}`{', ' + opts if opts else ''}{needs}")
    refused = [c for c in cells if c.status == "refused"]
    lines += ["", "## Refusals: documented limitations", ""]
    for lim in LIMITATIONS:
        mine = [c for c in refused if limitation(c) is lim]
        if mine:
            lines.append(f"- **{lim.title}** ({len(mine)} cells: {', '.join(c.key for c in mine)}): {lim.why}.")
            lines.append(f"  The message, e.g.: `{_first_line(mine[0].message)}`")
    other = [c for c in refused if limitation(c) is None]
    failed = [c for c in cells if c.status == "FAIL"]
    tied = [c for c in cells if c.status == "equal" and c.message]
    if tied:
        lines += ["", "## Equal once a near tie is resolved the other way", "", TIES_NOTE, ""]
        lines += [f"- **{c.key}**: {c.message}" for c in tied]
    for title, group in (("Refusals no limitation documents", other), ("Failures", failed)):
        if group:
            lines += ["", f"## {title}", ""]
            lines += [f"- **{c.key}**: `{_first_line(c.message)}`" for c in group]
    return "\n".join(lines) + "\n"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].replace("`", "'") if text.strip() else ""


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
