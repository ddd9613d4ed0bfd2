"""``meshfold calibrate`` on real gloo ranks: the probes on the session's pool, the fit of what they
measured read back from its file, the command end to end, and the refit of the link from a real
profiled step of collectives."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from meshfold.target.cluster_file import ClusterFile, read_cluster_file, write_cluster_file
from meshfold.target.hardware import local_cluster
from meshfold.tools.calibrate import fitting
from meshfold.tools.calibrate.from_trace import refit
from meshfold.tools.cli import main
from tests.dist.conftest import RankPools
from tests.unit.test_cluster_file import check_reproduces


def test_measured_points_fit_and_read_back(rank_pools: RankPools, tmp_path: Path) -> None:
    records = rank_pools.get(2).run("meshfold.tools.calibrate.probes:measure", quick=True)
    # NOTE: every rank reports the slowest rank's medians: the same points everywhere
    assert records[0]["points"] == records[1]["points"]
    points = records[0]["points"]
    assert {p["kind"] for p in points["collective"]} == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "p2p",
    }
    assert all(p["seconds"] > 0 for probe in ("launch", "stream", "gemm", "host") for p in points[probe])
    out = write_cluster_file(tmp_path / "cluster.json", fitting.fit(records[0]))
    back = read_cluster_file(out)
    check_reproduces(back)
    dev = back.cluster.device
    assert back.cluster.world_size == 2 and dev.name == "cpu"
    assert dev.eff.launch_s > 0 and dev.eff.collective_base_s + back.cluster.intra.latency_s > 0
    assert 0 < dev.eff.gemm_max <= 1 and 0 < dev.eff.mem_max <= 1
    assert back.measured["where"]["world_size"] == 2 and back.measured["where"]["torch"]


def test_calibrate_quick_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cluster.json"
    assert main(["calibrate", "--quick", "--ranks", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured vs fitted" in text and f"wrote {out}" in text
    # NOTE: the load the probes ran under is said beside the figures (a loaded host slows them)
    assert re.search(r"load average \d+\.\d\d before, \d+\.\d\d after, on \d+ cores", text)
    back = read_cluster_file(out)
    assert back.cluster.world_size == 2
    check_reproduces(back)
    data = json.loads(out.read_text())
    assert set(data["device"]["efficiency"]) >= {"gemm_max", "gemm_fill_s", "launch_s", "mem_max", "collective_base_s"}


def test_refit_from_a_profiled_step_lowers_a_too_fast_link(rank_pools: RankPools, tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    rank_pools.get(2).run("tests.dist.cases_calibrate:profiled_all_reduces", path=str(trace))
    start = local_cluster(2)
    fast = dataclasses.replace(start.intra, bw=start.intra.bw * 10)  # NOTE: ten times the catalog's gloo
    begin = ClusterFile(dataclasses.replace(start, intra=fast, inter=fast))
    got, report = refit(begin, trace)
    assert report["events"]["collective"] == 6 and report["link_bandwidth_refit"]
    assert got.cluster.intra.effective_bw < fast.effective_bw
    assert report["residuals_after"]["collective"]["rms_log"] < report["residuals_before"]["collective"]["rms_log"]
    assert "6 collectives" in got.sources["intra"]
