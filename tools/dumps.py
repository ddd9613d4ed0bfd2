"""Dumps of a graph between passes, for ``pass-debug --dump-dir``.

For every step ``NN`` (``00-input`` is the graph before any pass, then one step per pass) a
:class:`DumpWriter` writes ``NN-<pass>.txt`` (the IR text), ``NN-<pass>.dot`` (Graphviz),
``NN-<pass>.svg`` (only when Graphviz's ``dot`` is on PATH and the graph is small enough to lay out)
and ``NN-<pass>.html`` (the IR and a line diff against the previous step), plus an ``index.html``
listing the steps. Every file is a function of the graphs and the pipeline alone — no ids, clocks or
timings — so two runs over the same input write byte-identical files.
"""

from __future__ import annotations

import difflib
import html
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from meshfold.ir import Graph, Op, Value
from meshfold.ir.printer import Namer, fmt_type
from meshfold.passes import PassPipeline, pass_spelling

# NOTE: only files matching this pattern, and index.html, are ever removed from a dump directory.
_STEP_FILE = re.compile(r"^(?:capture-)?\d{2,}-[a-z0-9-]+\.(?:txt|dot|svg|html)$")
_SVG_TIMEOUT_S = 60.0
# NOTE: above _FAST_LAYOUT_OPS ops the .dot asks Graphviz for cheaper ranking and crossing minimization
# (the defaults take minutes on a 500-op joint graph); above _SVG_MAX_OPS no SVG is rendered at all.
_FAST_LAYOUT_OPS = 100
_SVG_MAX_OPS = 1500
# NOTE: phase -> (cluster title, cluster background, node fill); the order is the order clusters print.
_CLUSTERS = {"fwd": ("forward", "#eef4fb", "#cfe2f7"), "bwd": ("backward", "#fdf3ea", "#f9d9bf")}
_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
nav a, nav span { margin-right: 1em; }
pre, .diff { font-family: ui-monospace, monospace; font-size: 12px; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; }
.diff { border: 1px solid #ddd; overflow-x: auto; }
.diff div { padding: 0 0.4em; white-space: pre; }
.diff .n { display: inline-block; width: 4em; color: #999; text-align: right; margin-right: 0.6em; }
.add { background: #e6ffec; } .del { background: #ffebe9; }
details > summary { color: #666; background: #f1f3f5; cursor: pointer; padding: 0 0.4em; }
table { border-collapse: collapse; } td, th { border: 1px solid #ddd; padding: 0.2em 0.6em; text-align: right; }
td.l, th.l { text-align: left; } .note { color: #666; }
""".strip()


@dataclass(frozen=True)
class StepRecord:
    """What the index shows about one written step."""

    index: int
    stem: str
    spelling: str
    fwd_ops: int
    bwd_ops: int
    has_svg: bool

    @property
    def total_ops(self) -> int:
        return self.fwd_ops + self.bwd_ops


def phase_counts(graph: Graph) -> tuple[int, int]:
    """Return the number of forward and of backward ops in ``graph``."""
    fwd = sum(1 for op in graph.ops if op.prov.phase == "fwd")
    return fwd, len(graph.ops) - fwd


def _quote(text: str) -> str:
    """A Graphviz double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _label(text: str) -> str:
    """A quoted Graphviz label whose lines are left-justified."""
    return _quote(text).replace("\n", "\\l")[:-1] + '\\l"'


def _op_label(op: Op, names: Namer) -> str:
    results = ", ".join("%" + names.add(r) for r in op.results)
    lines = [f"{results} = {op.name}" if results else op.name]
    lines += [fmt_type(r.type, r.layout) for r in op.results]
    lines.append((op.prov.module or "<root>") + (f" @{op.prov.source}" if op.prov.source else ""))
    return "\n".join(lines)


def _source_node(v: Value, node_of: dict[Value, str], lines: list[str]) -> str:
    """The node defining ``v``; a red ``undefined`` node (added to ``lines``) for a broken graph."""
    if v not in node_of:
        node_of[v] = f"u{len(node_of)}"
        lines.append(f"  {node_of[v]} [label={_label('undefined %' + v.name)}, color=red];")
    return node_of[v]


def graph_to_dot(graph: Graph) -> str:
    """Graphviz text for ``graph``: a node per input, op and output, an edge per operand → user.

    Nodes are numbered by position (``i3``, ``o17``, ``x0``), forward and backward ops sit in their
    own clusters, and ``comm.*``/``mem.*`` ops are drawn bold, so equal graphs give equal text.
    """
    names = Namer()
    node_of: dict[Value, str] = {}
    fast = ", nslimit=2, nslimit1=2, mclimit=0.2" if len(graph.ops) > _FAST_LAYOUT_OPS else ""
    out = [f"digraph {_quote(graph.name)} {{", f'  graph [fontname="monospace", rankdir=TB{fast}];']
    out.append('  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];')
    out.append('  edge [color="#555555"];')
    out.append('  subgraph cluster_inputs {\n    label="inputs"; color="#bbbbbb";')
    for k, gi in enumerate(graph.inputs):
        node_of[gi.value] = f"i{k}"
        text = f"{gi.kind} %{names.add(gi.value)}\n{fmt_type(gi.value.type, gi.value.layout)}"
        out.append(f'    i{k} [label={_label(text)}, fillcolor="#eeeeee"];')
    out.append("  }")
    edges: list[str] = []
    clusters: dict[str, list[str]] = {phase: [] for phase in _CLUSTERS}
    for k, op in enumerate(graph.ops):
        for v in dict.fromkeys(op.operands):
            edges.append(f"  {_source_node(v, node_of, edges)} -> o{k};")
        fill = _CLUSTERS[op.prov.phase][2]
        bold = ", penwidth=2" if op.name.startswith(("comm.", "mem.")) else ""
        clusters[op.prov.phase].append(f'    o{k} [label={_label(_op_label(op, names))}, fillcolor="{fill}"{bold}];')
        for r in op.results:
            node_of[r] = f"o{k}"
    for phase, (title, background, _) in _CLUSTERS.items():
        if clusters[phase]:
            out.append(f'  subgraph cluster_{phase} {{\n    label="{title}"; style=filled; color="{background}";')
            out += clusters[phase]
            out.append("  }")
    out.append('  subgraph cluster_outputs {\n    label="outputs"; color="#bbbbbb";')
    for k, o in enumerate(graph.outputs):
        out.append(f'    x{k} [label={_label(f"output {o.kind}({o.name})")}, shape=ellipse, fillcolor="#ffffff"];')
        edges.append(f"  {_source_node(o.value, node_of, edges)} -> x{k};")
    out.append("  }")
    return "\n".join(out + edges + ["}"]) + "\n"


def render_svg(dot_path: Path) -> Path | None:
    """Render ``dot_path`` to an ``.svg`` beside it with Graphviz; ``None`` when ``dot`` is missing or fails."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    svg = dot_path.with_suffix(".svg")
    try:
        subprocess.run(
            [exe, "-Tsvg", "-o", str(svg), str(dot_path)], check=True, capture_output=True, timeout=_SVG_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        svg.unlink(missing_ok=True)
        return None
    return svg


def _line(cls: str, old: int | None, new: int | None, sign: str, text: str) -> str:
    nums = "".join(f'<span class="n">{n if n is not None else ""}</span>' for n in (old, new))
    return f'<div class="{cls}">{nums}{sign} {html.escape(text, quote=False)}</div>'


def diff_html(before: str | None, after: str, context: int = 3) -> str:
    """An HTML line diff of IR text ``before`` → ``after``: added lines green, removed red.

    Runs of unchanged lines longer than the ``context`` kept around each change fold into a
    ``<details>`` element (no script needed). ``before=None`` marks the initial graph.
    """
    if before is None:
        return '<p class="note">initial graph</p>'
    a, b = before.splitlines(), after.splitlines()
    if a == b:
        return '<p class="note">no change</p>'
    rows: list[str] = []
    added = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            rows += [_line("del", i + 1, None, "-", a[i]) for i in range(i1, i2)]
            rows += [_line("add", None, j + 1, "+", b[j]) for j in range(j1, j2)]
            removed, added = removed + i2 - i1, added + j2 - j1
            continue
        same = [_line("ctx", i + 1, j1 + i - i1 + 1, " ", a[i]) for i in range(i1, i2)]
        head = context if i1 > 0 else 0
        tail = context if i2 < len(a) else 0
        if len(same) <= head + tail + 1:
            rows += same
            continue
        hidden = same[head : len(same) - tail]
        rows += same[:head]
        rows.append(f"<details><summary>{len(hidden)} unchanged lines</summary>{''.join(hidden)}</details>")
        rows += same[len(same) - tail :]
    summary = f'<p class="note">{added} added, {removed} removed lines</p>'
    return summary + '\n<div class="diff">' + "\n".join(rows) + "</div>"


def _page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
        f"<style>\n{_CSS}\n</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n"
    )


class DumpWriter:
    """Writes one pipeline run's dumps into ``directory``: call :meth:`write_step` for the input graph
    and then after each pass, and :meth:`write_index` at the end (also after a failed pass)."""

    def __init__(self, directory: Path, pipeline: PassPipeline, *, title: str, svg: bool = True) -> None:
        self.directory = directory
        self.pipeline = pipeline
        self.title = title
        self.svg = svg
        width = max(2, len(str(len(pipeline.passes))))
        self.stems = [f"{0:0{width}d}-input"] + [f"{i:0{width}d}-{p.name}" for i, p in enumerate(pipeline.passes, 1)]
        self.spellings = ["input"] + [pass_spelling(p) for p in pipeline.passes]
        self.records: list[StepRecord] = []
        self.captures: list[tuple[str, str]] = []
        """(file name, capture pass) of each fx graph a capture pass left (``write_capture``)."""
        self._previous: str | None = None
        self._prepared = False

    def _prepare(self) -> None:
        """Create the directory and remove the step files an earlier run left in it (once)."""
        if self._prepared:
            return
        self._prepared = True
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.directory.iterdir()):
            if path.is_file() and (_STEP_FILE.match(path.name) or path.name == "index.html"):
                path.unlink()

    def write_capture(self, index: int, name: str, text: str) -> Path:
        """Write the fx graph capture pass ``index`` (``name``) left, before the IR existed."""
        self._prepare()
        path = self.directory / f"capture-{index + 1:02d}-{name}.txt"
        path.write_text(text, encoding="utf-8")
        self.captures.append((path.name, name))
        return path

    def write_step(self, graph: Graph) -> StepRecord:
        """Write the next step's ``.txt``, ``.dot``, ``.svg`` (if possible) and ``.html``; return its record."""
        index = len(self.records)
        if index >= len(self.stems):
            raise ValueError(f"pipeline {self.pipeline} has {len(self.stems) - 1} passes; no step {index} to dump")
        if index == 0:
            self._prepare()
        stem, text = self.stems[index], str(graph)
        base = self.directory / stem
        base.with_suffix(".txt").write_text(text, encoding="utf-8")
        base.with_suffix(".dot").write_text(graph_to_dot(graph), encoding="utf-8")
        small = len(graph.ops) <= _SVG_MAX_OPS
        has_svg = self.svg and small and render_svg(base.with_suffix(".dot")) is not None
        fwd, bwd = phase_counts(graph)
        record = StepRecord(index, stem, self.spellings[index], fwd, bwd, has_svg)
        base.with_suffix(".html").write_text(self._step_page(record, text), encoding="utf-8")
        self.records.append(record)
        self._previous = text
        return record

    def _step_page(self, rec: StepRecord, text: str) -> str:
        n = len(self.stems) - 1
        nav = ['<a href="index.html">index</a>']
        if rec.index > 0:
            nav.append(f'<a href="{self.stems[rec.index - 1]}.html">← {self.stems[rec.index - 1]}</a>')
        if rec.index < n:
            nav.append(f'<a href="{self.stems[rec.index + 1]}.html">{self.stems[rec.index + 1]} →</a>')
        exts = ("txt", "dot", "svg") if rec.has_svg else ("txt", "dot")
        files = [f'<a href="{rec.stem}.{ext}">{ext}</a>' for ext in exts]
        where = f"input graph, before pass 1 of {n}" if rec.index == 0 else f"pass {rec.index} of {n}"
        previous = self.records[-1].total_ops if self.records else None
        delta = "" if previous is None else f" ({rec.total_ops - previous:+d})"
        body = [
            f"<nav>{' '.join(nav)}</nav>",
            f"<h1>{rec.stem}: <code>{html.escape(rec.spelling)}</code></h1>",
            f"<p>{where} of <code>{html.escape(str(self.pipeline))}</code> on {html.escape(self.title)}</p>",
            f"<p>ops: {rec.fwd_ops} forward, {rec.bwd_ops} backward, {rec.total_ops} total{delta}"
            f" · files: {' '.join(files)}</p>",
            f"<h2>Diff against {self.stems[rec.index - 1]}</h2>" if rec.index else "<h2>Diff</h2>",
            diff_html(self._previous, text),
            "<h2>IR</h2>",
            f"<pre>{html.escape(text, quote=False)}</pre>",
        ]
        return _page(f"{rec.stem} · {self.title}", "\n".join(body))

    def write_index(self) -> Path:
        """Write ``index.html`` listing every step written so far with its op counts; return its path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        rows = [
            '<tr><th class="l">step</th><th class="l">pass</th><th>fwd ops</th><th>bwd ops</th><th>total</th>'
            "<th>change</th></tr>"
        ]
        previous: int | None = None
        for rec in self.records:
            change = "" if previous is None else f"{rec.total_ops - previous:+d}"
            rows.append(
                f'<tr><td class="l"><a href="{rec.stem}.html">{rec.stem}</a></td>'
                f'<td class="l"><code>{html.escape(rec.spelling)}</code></td><td>{rec.fwd_ops}</td>'
                f"<td>{rec.bwd_ops}</td><td>{rec.total_ops}</td><td>{change}</td></tr>"
            )
            previous = rec.total_ops
        missing = len(self.stems) - len(self.records)
        note = f'<p class="note">{missing} later steps were not reached.</p>' if missing else ""
        if self.captures:
            links = ", ".join(f'<a href="{f}"><code>{html.escape(n)}</code></a>' for f, n in self.captures)
            note = f"<p>capture passes (dynamo's fx graph after each, before the IR): {links}</p>\n{note}"
        body = (
            f"<h1>pass-debug: {html.escape(self.title)}</h1>\n"
            f"<p>pipeline <code>{html.escape(str(self.pipeline))}</code></p>\n"
            f"<table>\n" + "\n".join(rows) + f"\n</table>\n{note}"
        )
        path = self.directory / "index.html"
        path.write_text(_page(f"pass-debug · {self.title}", body), encoding="utf-8")
        return path
