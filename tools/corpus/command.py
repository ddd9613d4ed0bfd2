"""``meshfold corpus``: run the differential corpus's matrix (or a slice, or one cell) on local ranks."""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path
from typing import Any

SLICES = ("all", "ci")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--entry",
        action="append",
        default=[],
        metavar="GLOB",
        help="entries to run (a name or a glob such as 'hf-*'; repeat for more); default: all",
    )
    p.add_argument(
        "--column",
        action="append",
        default=[],
        metavar="GLOB",
        help="columns to run (a name, a glob, or a family such as 'pp'); default: all",
    )
    p.add_argument(
        "--slice",
        choices=SLICES,
        default="all",
        help="'ci': the fixed slice the test suite runs (every family on three or more entries)",
    )
    p.add_argument("--cell", metavar="ENTRY:COLUMN", help="run one cell and print its ranks' logs")
    p.add_argument("--list", action="store_true", help="list the entries and columns, run nothing")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps per cell")
    p.add_argument("--verify", action="store_true", help="compile every cell with verify=True")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a cell may take before it is a hang")
    p.add_argument("--json", type=Path, help="keep results here; cells already in it are not run again")
    p.add_argument("--markdown", type=Path, help="write the matrix as a markdown page (docs/corpus.md)")


def run(args: argparse.Namespace, console: Any) -> int:
    from meshfold.tools.corpus import columns as plans
    from meshfold.tools.corpus import entries as corpus_entries
    from meshfold.tools.corpus import matrix

    if args.cell:
        name, _, col = args.cell.partition(":")
        entry, column = corpus_entries.get(name), plans.column(col)
        cell = matrix.run_matrix([entry], [column], steps=args.steps, verify=args.verify, timeout=args.timeout)[0]
        console.print(f"{cell.key}: {cell.status} in {cell.seconds:.1f} s {cell.message}")
        if cell.log:
            print(cell.log)
        return 0 if cell.status != "FAIL" else 1
    entries, columns = select(args)
    if args.list:
        for e in entries:
            console.print(f"{e.name:24} {e.kind:16} {e.source}  [{', '.join(sorted(e.traits))}]")
        for c in columns:
            console.print(f"{c.name:24} {c.family:10} mesh {c.mesh}, plan {c.plan}")
        return 0
    done = matrix.load(args.json) if args.json else {}
    cells: list[matrix.Cell] = []

    def show(cell: matrix.Cell) -> None:
        if cell.status not in ("n/a", "skipped"):
            console.print(f"{cell.key}: {cell.status} ({cell.seconds:.1f} s) {cell.message[:200]}", markup=False)
        cells.append(cell)
        if args.json:
            matrix.save(list(done.values()) + cells, args.json)

    result = matrix.run_matrix(
        entries, columns, steps=args.steps, verify=args.verify, timeout=args.timeout, done=done, on_cell=show
    )
    console.print(matrix.rich_table(result, entries, columns))
    console.print(matrix.summary(result))
    if args.markdown:
        args.markdown.write_text(matrix.markdown(result, entries, columns))
        console.print(f"wrote {args.markdown}")
    return 1 if any(c.status == "FAIL" for c in result) else 0


def select(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """The entries and columns ``args`` name (``--slice ci``: the suite's slice)."""
    from meshfold.tools.corpus import columns as plans
    from meshfold.tools.corpus import entries as corpus_entries

    if args.slice == "ci":
        from meshfold.tools.corpus.slice import CI_SLICE

        names = {e for e, _ in CI_SLICE}
        cols = {c for _, c in CI_SLICE}
        return [corpus_entries.get(n) for n in sorted(names)], [c for c in plans.COLUMNS if c.name in cols]
    entries = [e for e in corpus_entries.entries() if _picked(e.name, args.entry)]
    columns = [c for c in plans.COLUMNS if _picked(c.name, args.column) or c.family in args.column]
    if not entries or not columns:
        print("meshfold corpus: no entry or no column matches", file=sys.stderr)
    return entries, columns


def _picked(name: str, globs: list[str]) -> bool:
    return not globs or any(fnmatch.fnmatchcase(name, g) for g in globs)
