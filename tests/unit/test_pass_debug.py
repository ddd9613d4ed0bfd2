"""The ``pass-debug`` CLI, called in-process through ``tools.pass_debug.main``."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshfold import ir
from meshfold.tools import dumps
from meshfold.tools.pass_debug import main

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "ir_corpus"

JOINT = """\
graph @g {
  param %w : f32[4, 4]
  input %x : f32[2, 4]
  tangent %g : f32[]
  %t = aten.t(%w) : f32[4, 4]  # lin fwd @m.py:3
  %mm = aten.mm(%x, %t) : f32[2, 4]  # lin fwd @m.py:3
  %d = aten.detach(%mm) : f32[2, 4]  # <root> fwd
  %s = aten.sum(%d) : f32[]  # <root> fwd
  %e = aten.expand(%g, [2, 4]) : f32[2, 4]  # <root> bwd
  %tx = aten.t(%e) : f32[4, 2]  # lin bwd @m.py:3
  %gw = aten.mm(%tx, %x) : f32[4, 4]  # lin bwd @m.py:3
  output out(0) = %s
  output grad(w) = %gw
}
"""

# NOTE: JOINT after `cleanup`: the detach of %mm is gone and the sum reads %mm directly.
CLEANED = """\
graph @g {
  param %w : f32[4, 4]
  input %x : f32[2, 4]
  tangent %g : f32[]
  %t = aten.t(%w) : f32[4, 4]  # lin fwd @m.py:3
  %mm = aten.mm(%x, %t) : f32[2, 4]  # lin fwd @m.py:3
  %s = aten.sum(%mm) : f32[]  # <root> fwd
  %e = aten.expand(%g, [2, 4]) : f32[2, 4]  # <root> bwd
  %tx = aten.t(%e) : f32[4, 2]  # lin bwd @m.py:3
  %gw = aten.mm(%tx, %x) : f32[4, 4]  # lin bwd @m.py:3
  output out(0) = %s
  output grad(w) = %gw
}
"""

FACTORY_MODULE = """\
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).relu().sum()


def make():
    torch.manual_seed(0)
    return Tiny(), (torch.randn(2, 4),)
"""


@pytest.fixture
def ir_file(tmp_path: Path) -> Path:
    path = tmp_path / "joint.ir"
    path.write_text(JOINT)
    return path


def _dump_sections(stdout: str) -> list[tuple[str, ir.Graph]]:
    """Split printed IR at the ``// -----`` headers and parse every graph."""
    parts = re.split(r"^// ----- (.*) -----$", stdout, flags=re.M)
    assert parts[0] == ""
    return [(parts[i], ir.parse(parts[i + 1])) for i in range(1, len(parts), 2)]


def _tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_print_after_round_trips_the_cleaned_ir(ir_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(ir_file), "-p", "cleanup", "--print-after", "cleanup"]) == 0
    out = capsys.readouterr().out
    # NOTE: header lines are `//` comments, which the parser skips, so the output parses as is.
    assert str(ir.parse(out)) == CLEANED


def test_print_between_passes_shows_input_and_every_pass(ir_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(ir_file), "-p", "cleanup,verify", "--print-between-passes", "--no-color"]) == 0
    sections = _dump_sections(capsys.readouterr().out)
    assert [header.split(" (")[0] for header, _ in sections] == [
        "IR before the pipeline",
        "IR after pass 1 of 2",
        "IR after pass 2 of 2",
    ]
    assert [str(g) for _, g in sections] == [JOINT, CLEANED, CLEANED]


def test_summary_without_print_options(ir_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(ir_file), "-p", "cleanup", "--no-color"]) == 0
    out = capsys.readouterr().out
    rows = [re.findall(r"[\w-]+", line) for line in out.splitlines() if line.startswith("│")]
    assert rows == [["0", "input", "4", "3", "7"], ["1", "cleanup", "3", "3", "6"]]


def test_time_passes_goes_to_stderr_only(ir_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(ir_file), "-p", "cleanup,verify", "--print-after", "verify", "--time-passes"]) == 0
    captured = capsys.readouterr()
    assert str(ir.parse(captured.out)) == CLEANED
    assert "pass timings" in captured.err
    assert re.search(r"cleanup\s*│\s*\d+\.\d{4}", captured.err)
    assert re.search(r"verify\s*│\s*\d+\.\d{4}", captured.err)


def test_dump_dir_writes_every_step(ir_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dumps.shutil, "which", lambda name: None)
    out = tmp_path / "dumps"
    assert main([str(ir_file), "-p", "cleanup,verify", "--dump-dir", str(out)]) == 0
    stems = ["00-input", "01-cleanup", "02-verify"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["index.html"] + [f"{s}.{ext}" for s in stems for ext in ("txt", "dot", "html")]
    )
    assert [(out / f"{s}.txt").read_text() for s in stems] == [JOINT, CLEANED, CLEANED]
    page = (out / "01-cleanup.html").read_text()
    removed = re.findall(r'<div class="del">.*?[-] (.*?)</div>', page)
    added = re.findall(r'<div class="add">.*?[+] (.*?)</div>', page)
    assert [line.strip() for line in removed] == [
        "%d = aten.detach(%mm) : f32[2, 4]  # &lt;root&gt; fwd",
        "%s = aten.sum(%d) : f32[]  # &lt;root&gt; fwd",
    ]
    assert [line.strip() for line in added] == ["%s = aten.sum(%mm) : f32[]  # &lt;root&gt; fwd"]
    assert "initial graph" in (out / "00-input.html").read_text()
    assert "no change" in (out / "02-verify.html").read_text()
    index = (out / "index.html").read_text()
    assert re.findall(r'href="(\d\d-[a-z-]+)\.html"', index) == stems
    assert ".svg" not in page


def test_dot_has_one_edge_per_operand_and_phase_clusters(ir_file: Path) -> None:
    graph = ir.parse(JOINT)
    text = dumps.graph_to_dot(graph)
    label_of = {m[0]: m[1] for m in re.findall(r"^\s+(\w+) \[label=\"(.*?)\\l", text, flags=re.M)}
    edges = {(label_of[a], label_of[b]) for a, b in re.findall(r"^\s+(\w+) -> (\w+);", text, flags=re.M)}

    def label(v: ir.Value) -> str:
        for i in graph.inputs:
            if i.value is v:
                return f"{i.kind} %{v.name}"
        return f"%{v.name} = {graph.producers()[v].name}"

    expected = {(label(v), label(op.results[0])) for op in graph.ops for v in op.operands}
    expected |= {(label(o.value), f"output {o.kind}({o.name})") for o in graph.outputs}
    assert edges == expected
    bwd_block = text.split("subgraph cluster_bwd {")[1].split("\n  }")[0]
    assert sorted(re.findall(r"\"(%\w+) =", bwd_block)) == ["%e", "%gw", "%tx"]


def test_dumps_are_byte_identical_across_runs(ir_file: Path, tmp_path: Path) -> None:
    trees = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert main([str(ir_file), "-p", "cleanup,verify", "--mesh", "dp=2", "--dump-dir", str(out)]) == 0
        trees.append(_tree(out))
    assert trees[0] == trees[1]
    assert ("00-input.svg" in trees[0]) == (dumps.shutil.which("dot") is not None)


def test_dump_dir_replaces_stale_steps_only(ir_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "dumps"
    out.mkdir()
    (out / "07-sharding.txt").write_text("old")
    (out / "notes.md").write_text("mine")
    assert main([str(ir_file), "-p", "cleanup", "--dump-dir", str(out)]) == 0
    assert not (out / "07-sharding.txt").exists()
    assert (out / "notes.md").read_text() == "mine"


def test_diff_folds_long_unchanged_runs() -> None:
    before = "\n".join(f"line {i}" for i in range(20))
    after = before.replace("line 10", "line ten")
    page = dumps.diff_html(before, after, context=2)
    assert re.findall(r"<summary>(\d+) unchanged lines</summary>", page) == ["8", "7"]
    assert re.findall(r'class="(?:add|del)">.*?([-+] line \w+)</div>', page) == ["- line 10", "+ line ten"]
    assert dumps.diff_html(None, after) == '<p class="note">initial graph</p>'


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-p", "cleanup,nope"], "unknown pass 'nope'"),
        (["-p", "cleanup{fast=true}"], "has no option 'fast'"),
        (["--mesh", "dp=two"], "--mesh 'dp=two' is malformed"),
        (["-p", "cleanup,verify", "--print-after", "sharding"], "no pass named 'sharding'"),
    ],
)
def test_bad_options_exit_2(ir_file: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    assert main([str(ir_file), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (JOINT.replace("aten.sum(%d)", "aten.sum(%nope)"), "%nope is used before it is defined"),
        (JOINT.replace("f32[2, 4]  # <root> fwd", "f32[2, 4  # <root> fwd"), "bad.ir:7:"),
        (JOINT.replace("aten.detach", "aten.no_such_op"), "no_such_op"),
    ],
)
def test_bad_ir_text_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str) -> None:
    path = tmp_path / "bad.ir"
    path.write_text(text)
    assert main([str(path), "-p", "cleanup"]) == 2
    err = capsys.readouterr().err
    assert "cannot parse IR" in err and needle in err and "Traceback" not in err


def test_unknown_model_and_missing_file_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-model", "-p", "cleanup"]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["missing.ir", "-p", "cleanup"]) == 2
    assert "IR file 'missing.ir' does not exist" in capsys.readouterr().err


def test_verify_names_the_failing_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "wrong-type.ir"
    path.write_text(JOINT.replace("%gw = aten.mm(%tx, %x) : f32[4, 4]", "%gw = aten.mm(%tx, %x) : f32[4, 5]"))
    assert main([str(path), "-p", "cleanup", "--verify"]) == 2
    assert "verification failed on the input graph" in capsys.readouterr().err
    assert main([str(path), "-p", "cleanup,verify"]) == 2
    assert "pass 2 of 2 (verify) failed" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "line", "error"),
    [
        ("addmm_i64_operand", 6, "aten.addmm at <root> (fwd): operand %x of aten.addmm is i64 where f32 is required"),
        ("mm_i64_in_sharded_graph", 7, "aten.mm at layers.0.mlp (bwd): operand %w of aten.mm is i64 where f32 is"),
    ],
)
def test_verify_errors_name_the_ir_file_and_line(
    name: str, line: int, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = CORPUS / f"{name}.ir"
    assert main([str(path), "-p", "cleanup", "--verify"]) == 2
    err = capsys.readouterr().err
    assert f"verification failed on the input graph (IR file {path}): {path}:{line}:3: {error}" in err


def test_errors_after_passes_still_name_the_ir_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The default pipeline's closing verify pass reads ops that eight passes rebuilt; the addmm kept its
    provenance, and with it where the file wrote it."""
    path = CORPUS / "addmm_i64_operand.ir"
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert f"(verify) failed: VerifyError: {path}:6:3: aten.addmm at <root> (fwd): operand %x of aten.addmm" in err


def test_a_pass_describing_an_op_names_its_ir_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Errors that passes build with ``Op.describe`` (here the verify pass's layout check) name the IR line."""
    path = tmp_path / "layouts.ir"
    path.write_text(
        "graph @g mesh<dp=2> {\n"
        "  input %x : f32[4, 8] {dp: S(0)}\n"
        "  %y = aten.neg(%x) : f32[4, 8] {dp: S(1)}  # layers.0 fwd @m.py:3\n"
        "  output out(0) = %y\n"
        "}\n"
    )
    assert main([str(path), "-p", "verify"]) == 2
    err = capsys.readouterr().err
    assert f"aten.neg at layers.0 (fwd, m.py:3) [{path}:3:3]: on mesh axis 'dp' the placements" in err


def test_module_factory_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pd_tiny_factory.py").write_text(FACTORY_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "pd_tiny_factory", raising=False)
    assert main(["pd_tiny_factory:make", "-p", "cleanup", "--print-after", "cleanup", "--verify"]) == 0
    graph = ir.parse(capsys.readouterr().out)
    assert [(i.kind, i.name) for i in graph.inputs if i.kind == "param"] == [
        ("param", "lin.weight"),
        ("param", "lin.bias"),
    ]
    assert {(o.kind, o.name) for o in graph.outputs} == {("out", "0"), ("grad", "lin.weight"), ("grad", "lin.bias")}
    assert {op.prov.phase for op in graph.ops} == {"fwd", "bwd"}
    assert main(["pd_tiny_factory:nope", "-p", "cleanup"]) == 2
    assert "has no attribute 'nope'" in capsys.readouterr().err
    assert main(["pd_no_such_module:make", "-p", "cleanup"]) == 2
    assert "cannot import module 'pd_no_such_module'" in capsys.readouterr().err
    sys.modules.pop("pd_tiny_factory", None)


@pytest.mark.skipif(importlib.util.find_spec("meshfold.tools.zoo") is None, reason="compiler.zoo is not written yet")
def test_zoo_mlp_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mlp"
    assert main(["mlp", "-p", "cleanup,verify", "--verify", "--dump-dir", str(out), "--no-color"]) == 0
    assert str(out / "index.html") in capsys.readouterr().out
    captured = ir.parse((out / "00-input.txt").read_text())
    cleaned = ir.parse((out / "01-cleanup.txt").read_text())
    assert {op.prov.phase for op in captured.ops} == {"fwd", "bwd"}
    assert [o.name for o in cleaned.outputs] == [o.name for o in captured.outputs]
    assert (out / "02-verify.txt").read_text() == (out / "01-cleanup.txt").read_text()


def test_runs_as_a_module(ir_file: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "meshfold.tools.pass_debug", str(ir_file), "-p", "cleanup", "--print-after", "cleanup"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert str(ir.parse(proc.stdout)) == CLEANED


def test_dump_dir_that_is_a_file_exits_2(ir_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(ir_file), "-p", "cleanup", "--dump-dir", str(ir_file)]) == 2
    assert f"--dump-dir {ir_file} exists and is not a directory" in capsys.readouterr().err
    assert ir_file.read_text() == JOINT


# NOTE: expert weights far larger than the tokens, as in real MoE layers, so the sharding solve
# keeps them split (at a few KiB it rather gathers them: a collective costs ~1 ms on gloo).
MOE = """\
graph @moe {
  param %experts.gate_up_proj : f32[4, 2048, 256]
  param %experts.down_proj : f32[4, 256, 1024]
  input %x : f32[8, 256]
  input %idx : i64[8, 2]
  input %w : f32[8, 2]
  tangent %tangent.0 : f32[]
  %gu = aten.view(%experts.gate_up_proj, [4, 2, 1024, 256]) : f32[4, 2, 1024, 256]  # experts fwd
  %e = meshfold.moe_experts(%x, %idx, %w, %gu, %experts.down_proj, "silu", 0, "probs", "allgather") : f32[8, 256] \
 # experts fwd
  %s = aten.sum(%e) : f32[]  # <root> fwd
  %g = aten.expand(%tangent.0, [8, 256]) : f32[8, 256]  # <root> bwd
  %b.0, %b.1, %b.2, %b.3 = meshfold.moe_experts_backward(%g, %x, %idx, %w, %gu, %experts.down_proj, "silu", 0, \
"probs", "allgather") : f32[8, 256], f32[8, 2], f32[4, 2, 1024, 256], f32[4, 256, 1024]  # experts bwd
  %ggu = aten.view(%b.2, [4, 2048, 256]) : f32[4, 2048, 256]  # experts bwd
  output out(0) = %s
  output grad(experts.gate_up_proj) = %ggu
  output grad(experts.down_proj) = %b.3
}
"""


def _table_rows(out: str, title: str) -> list[list[str]]:
    """The body rows of the rich table titled ``title`` in ``out``, cells stripped."""
    section = out.split(title, 1)[1]
    rows = []
    for line in section.splitlines()[4:]:
        if not line.startswith("│"):
            break
        rows.append([cell.strip() for cell in line.strip("│").split("│")])
    return rows


@pytest.fixture
def moe_file(tmp_path: Path) -> Path:
    path = tmp_path / "moe.ir"
    path.write_text(MOE)
    return path


def test_moe_shows_both_mappings_and_the_experts_layouts(moe_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        str(moe_file),
        "-p",
        "moe-fold,sharding,boxing,verify",
        "--mesh",
        "dp=2,tp=2",
        "--moe",
        "ep=4",
        "--no-color",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert _table_rows(out, "MoE mapping") == [["dp", "2", "fsdp", "EP"], ["tp", "2", "tp", "EP"]]
    assert "attention: fsdp over dp, tp over tp; experts: EP=4 over (dp, tp), EDP=1" in out
    # NOTE: the all-to-all dispatcher (moe='s default, as in parallelize): tokens split like the experts
    experts = _table_rows(out, "experts ops (2)")
    assert [row[1:] for row in experts] == [
        ["fwd", "{dp: S(0), tp: S(0)}", "{dp: S(0), tp: S(0)}"],
        ["bwd", "{dp: S(0), tp: S(0)}", "{dp: S(0), tp: S(0)}"],
    ]
    assert main([*argv[:-1], "--moe", "ep=4,dispatcher=allgather", "--no-color"]) == 0
    gathered = _table_rows(capsys.readouterr().out, "experts ops (2)")
    assert [row[2] for row in gathered] == ["replicated", "replicated"]


def test_moe_on_the_inner_axis_leaves_the_outer_one_edp(moe_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(moe_file), "-p", "moe-fold,sharding,boxing", "--plan", "ddp+tp", "--mesh", "dp=2,tp=2", "--moe", "ep=2"]
    assert main([*argv, "--no-color"]) == 0
    out = capsys.readouterr().out
    assert _table_rows(out, "MoE mapping") == [["dp", "2", "ddp", "EDP"], ["tp", "2", "tp", "EP"]]
    assert "experts: EP=2 over tp, EDP=2 over dp" in out
    assert all("tp: S(0)" in row[3] for row in _table_rows(out, "experts ops (2)"))


def test_experts_without_moe_follow_the_plan(moe_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(moe_file), "-p", "sharding,boxing", "--mesh", "dp=2", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert _table_rows(out, "MoE mapping") == [["dp", "2", "fsdp", "as attention"]]
    assert "experts: as attention (no expert mapping)" in out


def test_graphs_without_experts_get_no_moe_tables(ir_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(ir_file), "-p", "cleanup,sharding,boxing", "--mesh", "dp=2", "--no-color"]) == 0
    assert "MoE mapping" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-p", "moe-fold,sharding,boxing", "--moe", "ep=2"], "give a mesh"),
        (["-p", "cleanup", "--mesh", "dp=2", "--moe", "ep=2"], "needs the moe-fold pass"),
        (["-p", "sharding,moe-fold", "--mesh", "dp=2", "--moe", "ep=2"], "(moe-fold) requires ['joint']"),
        (["-p", "sharding", "--mesh", "dp=2", "--moe", "ep"], "key=value"),
        (["-p", "sharding", "--mesh", "dp=2", "--moe", "ep=2,speed=9"], "unknown keys ['speed']"),
        (["-p", "sharding", "--mesh", "dp=2,tp=2", "--moe", "ep=3"], "no such run of axes has 3 ranks"),
    ],
)
def test_bad_moe_options_exit_2(
    moe_file: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert main([str(moe_file), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_moe_spec_and_mapping_line() -> None:
    from meshfold.passes.sharding.plans import Plan
    from meshfold.tools.common import mapping_line, parse_moe
    from meshfold.tracing.moe_layers import MoeSpec

    assert parse_moe("ep=4, etp=1") == MoeSpec(ep=4, etp=1)
    assert parse_moe("ep=2,dispatcher=allgather,hierarchical=false") == MoeSpec(ep=2, dispatcher="allgather")
    mesh = ir.Mesh.parse("dp=2,tp=4")
    line = mapping_line(Plan.of("fsdp+tp"), mesh, MoeSpec(ep=4))
    assert line == "attention: fsdp over dp, tp over tp; experts: EP=4 over tp, EDP=2 over dp"


@pytest.mark.skipif(importlib.util.find_spec("meshfold.tools.zoo") is None, reason="compiler.zoo is not written yet")
def test_zoo_moe_model_maps_its_experts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "mixtral-tiny",
        "-p",
        "cleanup,moe-fold,sharding{mode=greedy},boxing,verify",
        "--mesh",
        "dp=2,tp=2",
        "--moe",
        "ep=4",
    ]
    assert main([*argv, "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "experts: EP=4 over (dp, tp), EDP=1" in out
    rows = _table_rows(out, "experts ops (4)")
    assert [row[1] for row in rows] == ["fwd", "fwd", "bwd", "bwd"]
    assert all(row[3] == "{dp: S(0), tp: S(0)}" for row in rows)


def test_the_summary_says_what_the_memory_pass_decided(capsys: pytest.CaptureFixture[str]) -> None:
    """``--memory full`` recomputes both blocks of the golden two-block graph; the summary names them
    and the predicted peak falls."""
    path = Path(__file__).parents[1] / "golden" / "memory" / "full-blocks.ir"
    assert main([str(path), "-p", "memory,verify", "--assume", "boxed", "--memory", "full", "--no-color"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("memory:"))
    want = r"memory: policy full; recomputed layers\.0, layers\.1 \(\+[\d.]+ ms\); predicted peak per rank "
    m = re.fullmatch(want + r"([\d.]+) KiB -> ([\d.]+) KiB", line)
    assert m is not None and float(m[2]) < float(m[1]), line


def test_cp_flag_chooses_how_attention_reads_the_split_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    """``--cp`` is ``parallelize(cp=...)``: the summary says how each attention reads the sequence."""
    for method, how in (("tokenring", "by sequence (TokenRing)"), ("ulysses", "by heads (Ulysses)")):
        assert main(["llama-tiny", "--mesh", "cp=4", "--plan", "cp", "--cp", method, "--no-color"]) == 0
        out = capsys.readouterr().out
        assert f"context parallel on 'cp': attention split 2 {how}" in out.splitlines()
    assert main(["llama-tiny", "--mesh", "tp=2", "--plan", "tp", "--cp", "ring"]) == 2
    assert "cp= says how attention reads a sequence split over a cp mesh axis" in capsys.readouterr().err


def test_print_after_overlap_of_an_output_the_backward_computes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``mm_i64_in_sharded_graph.ir`` with its operand f32: the output's all-reduce (tagged ``fwd``) of the
    backward's GEMM is scheduled after it, so the IR printed after ``overlap`` reads back and verifies (the
    printer crashed on a start before its operand); with the i64 operand the closing verify pass names
    the dtype, without a traceback."""
    original = CORPUS / "mm_i64_in_sharded_graph.ir"
    path = tmp_path / "mm_f32.ir"
    path.write_text(original.read_text().replace("input %w : i64", "input %w : f32"))
    assert main([str(path), "--print-after", "overlap", "--no-color"]) == 0
    printed = capsys.readouterr().out.split("-----\n", 1)[1]
    graph = ir.parse(printed)
    ir.verify(graph)
    assert str(graph) == printed and any(op.name == "comm.all_reduce" for op in graph.ops)
    assert main([str(original), "--print-after", "overlap", "--no-color"]) == 2
    err = capsys.readouterr().err
    assert "(verify) failed" in err and "operand %w of aten.mm is i64 where f32 is required" in err
    assert "Traceback" not in err


def test_list_passes_names_every_capture_and_ir_pass(capsys: pytest.CaptureFixture[str]) -> None:
    from meshfold.passes import default_registry
    from meshfold.rewrites.capture_passes import CAPTURE_PASSES

    assert main(["--list-passes", "--no-color"]) == 0
    out = capsys.readouterr().out
    missing = [n for n in (*CAPTURE_PASSES, *default_registry()) if n not in out]
    assert not missing and len(CAPTURE_PASSES) == 4


def test_capture_passes_are_chosen_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    """hf-llama-eager writes its attention out: one fused attention op per layer only with fuse-attention."""
    from meshfold import Options, compile_model
    from meshfold.tools.zoo import build

    model, inputs = build("hf-llama-eager")

    def fused(capture: str | None) -> int:
        graph = compile_model(model, inputs, Options.of(capture=capture, pipeline="cleanup")).graph
        return sum("scaled_dot_product" in str(op.target) for op in graph.ops if op.prov.phase == "fwd")

    assert fused(None) == fused("fuse-attention") > 0
    assert fused("fold-scans") == 0
    assert main(["gpt2-tiny", "-p", "cleanup", "--capture", "fuse-attention,fuse-everything"]) == 2
    assert "unknown capture pass 'fuse-everything'" in capsys.readouterr().err
