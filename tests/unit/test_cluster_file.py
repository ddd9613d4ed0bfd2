"""Cluster files (``meshfold calibrate --out``): exact round trips, refusals that name the field,
the fit on points the model itself made, the loader behind ``cluster=`` and ``meshfold plan``, and
the refit from a real profiler trace."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from meshfold.passes import PassError
from meshfold.passes.options import Options
from meshfold.target.cluster_file import ClusterFile, load_cluster, read_cluster_file, write_cluster_file
from meshfold.target.hardware import Cluster, local_cluster, parse_cluster
from meshfold.tools.calibrate import fitting, probes
from meshfold.tools.calibrate.from_trace import refit
from meshfold.tools.cli import main


def _file(tmp_path: Path, cluster: Cluster, measured: dict[str, Any] | None = None) -> Path:
    sources = {"device.peak.fp32": "measured: a test"}
    return write_cluster_file(tmp_path / "cluster.json", ClusterFile(cluster, sources, measured or {"x": [1.5, 2]}))


@pytest.mark.parametrize("text", ["h100:8x2", "ascend910b:8x1", "cpu:4x1"])
def test_round_trip_is_exact(tmp_path: Path, text: str) -> None:
    cluster = parse_cluster(text)
    measured = {"where": {"host": "h", "world_size": 4}, "points": {"gemm": [{"m": 3, "seconds": 0.1 + 0.2}]}}
    back = read_cluster_file(_file(tmp_path, cluster, measured))
    assert back.cluster == cluster
    assert back.sources == {"device.peak.fp32": "measured: a test"}
    assert back.measured == measured
    assert math.isinf(parse_cluster("cpu:4x1").device.hbm_bytes)  # NOTE: written as null, read back as inf


def _mutate(data: dict[str, Any], path: str, value: Any) -> None:
    *head, last = path.split(".")
    for key in head:
        data = data[key]
    if value is KeyError:
        del data[last]
    else:
        data[last] = value


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("device.efficiency.gemm_max", KeyError, "device.efficiency.gemm_max is missing"),
        ("device.efficiency.gemm_max", 1.5, "device.efficiency.gemm_max is a fraction"),
        ("device.efficiency.launch_s", -1e-6, "device.efficiency.launch_s must be >= 0"),
        ("intra.bw", 0, "intra.bw must be > 0"),
        ("intra.bw", "fast", "intra.bw must be a finite number"),
        ("nodes", 1.5, "nodes must be a positive integer"),
        ("devices_per_node", True, "devices_per_node must be a positive integer"),
        ("device.peak", {}, "device.peak must name"),
        ("device.peak.fp32", None, "device.peak.fp32 must be a finite number"),
        ("device.name", "", "device.name must be a non-empty string"),
        ("device.speed", 3, "device.speed is not a cluster file field"),
        ("format", "other", "format must be"),
        ("version", 99, "version must be 1"),
        ("inter", [], "inter must be a JSON object"),
    ],
)
def test_bad_file_is_refused_naming_the_field(tmp_path: Path, path: str, value: Any, field: str) -> None:
    good = _file(tmp_path, parse_cluster("cpu:4x1"))
    data = json.loads(good.read_text())
    _mutate(data, path, value)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"cluster file {bad}: field {field}"):
        read_cluster_file(bad)


def test_not_json_nan_and_missing_files_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"cluster file {bad}: not JSON"):
        read_cluster_file(bad)
    data = json.loads(_file(tmp_path, parse_cluster("cpu:2x1")).read_text())
    bad.write_text(json.dumps(data).replace('"hbm_bw": 4000000000.0', '"hbm_bw": NaN'))
    with pytest.raises(ValueError, match="NaN is not a number a cluster file may hold"):
        read_cluster_file(bad)
    with pytest.raises(ValueError, match=r"missing\.json: cannot be read.*meshfold calibrate"):
        read_cluster_file(tmp_path / "missing.json")


def test_write_is_atomic_and_leaves_no_temporary(tmp_path: Path) -> None:
    out = _file(tmp_path, parse_cluster("cpu:2x1"))
    with pytest.raises(ValueError, match="node groups"):
        write_cluster_file(out, ClusterFile(parse_cluster("h100:8x1@ib+h100:8x1@roce")))
    assert read_cluster_file(out).cluster == parse_cluster("cpu:2x1")  # NOTE: the old file is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.json"]


def test_load_cluster_reads_text_or_file_and_resizes(tmp_path: Path) -> None:
    assert load_cluster("h100:8x4") == parse_cluster("h100:8x4")
    host = _file(tmp_path, local_cluster(4))
    assert load_cluster(str(host)) == local_cluster(4)
    assert load_cluster(str(host), 8).world_size == 8  # NOTE: a one-node file grows its node
    assert load_cluster(str(host), 8).device == local_cluster(4).device
    multi = write_cluster_file(tmp_path / "multi.json", ClusterFile(parse_cluster("h100:8x2")))
    assert load_cluster(str(multi), 24) == parse_cluster("h100:8x3")
    with pytest.raises(ValueError, match="12 ranks does not fill nodes of 8 devices"):
        load_cluster(str(multi), 12)


def test_options_read_a_cluster_file(tmp_path: Path) -> None:
    path = _file(tmp_path, local_cluster(4))
    assert Options.of(cluster=str(path), mesh="dp=2,tp=2").cluster == local_cluster(4)
    assert Options.of(cluster=path, mesh="dp=4,tp=2").cluster == local_cluster(8)
    assert Options.of(cluster=str(path)).cluster == local_cluster(4)
    with pytest.raises(PassError, match=r"nope\.json.*cannot be read"):
        Options.of(cluster=str(tmp_path / "nope.json"))


def test_plan_reads_a_cluster_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _file(tmp_path, local_cluster(4))
    args = ["plan", "--model", "llama3-8b", "--seq", "512", "--global-batch", "8", "--dtype", "fp32", "--json"]
    assert main([*args, "--cluster", str(path)]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main([*args, "--cluster", "cpu:4x1"]) == 0
    from_text = json.loads(capsys.readouterr().out)
    for row in (from_file, from_text):
        row.pop("solve_time_s")
    assert from_file == from_text
    assert main([*args, "--cluster", str(tmp_path / "none.json")]) == 2
    assert "none.json: cannot be read" in capsys.readouterr().err


# --- the fit, on points the time model itself produced --------------------------------------------

TRUE_ALONE = {"fp32": 2.0, "stream": 1.25, "p2p_bw": 3e9}


def _truth() -> Cluster:
    base = local_cluster(4)
    dev = fitting.with_peaks(base.device, {"fp32": 4e10, "bf16": 1.5e9})
    dev = fitting.with_figures(
        dev,
        gemm_max=1.0,
        gemm_fill_s=3e-6,  # NOTE: separate from launch_s: it sits inside the roofline's max
        gemm_k_half=6.0,
        gemm_mn_half=500.0,
        mem_max=1.0,
        mem_ramp_s=0.0,
        attn_fwd_max=0.3,
        attn_bwd_max=0.2,
        launch_s=5e-6,
        collective_base_s=4e-4,
        hbm_bw=1e10,
        host_bw=3e8,
    )
    link = dataclasses.replace(base.intra, bw=1.5e9, latency_s=1e-3, efficiency=1.0)
    return dataclasses.replace(base, device=dev, intra=link, inter=link)


def _record(truth: Cluster) -> dict[str, Any]:
    """What ``probes.measure`` would return on ranks that run exactly as ``truth`` prices."""
    grid, dev = probes.FULL, truth.device
    shapes = [(n, n, n) for n in grid.squares] + list(grid.skinny)
    points: dict[str, Any] = {
        "launch": [{"op": "tiny", "bytes": b} for b in (8, 512, 768)],
        "stream": [{"op": "copy", "size": s, "bytes": 2 * s} for s in grid.stream_bytes],
        "gemm": [{"dtype": d, "m": m, "n": n, "k": k} for d in ("fp32", "bf16") for m, n, k in shapes],
        "collective": [
            {"kind": kind, "size": size, "per_node": size, "nodes": 1, "bytes": b}
            for size in (4, 2)
            for kind in probes.KINDS
            for b in grid.comm_bytes
            if kind != "p2p" or size == 2
        ],
        "host": [{"op": "offload+reload", "size": s, "bytes": 2 * s} for s in grid.host_bytes],
        "attention": [
            {"seq": seq, "heads": probes.HEADS, "dim": dim, "dtype": "fp32", "pass": which}
            for seq, dim in grid.attention
            for which in ("fwd", "bwd")
        ],
    }
    prices = {
        "launch": fitting.price_memory(dev),
        "stream": fitting.price_memory(dev),
        "gemm": fitting.price_gemm(dev),
        "collective": fitting.price_collective(truth),
        "host": fitting.price_host(dev),
        "attention": fitting.price_attention(dev),
    }
    for probe, pts in points.items():
        for p in pts:
            p["seconds"] = prices[probe](p)
    n = max(grid.squares)
    big, msg = max(grid.stream_bytes), max(grid.comm_bytes)
    floor = truth.intra.latency_s + dev.eff.collective_base_s
    points["solo"] = {
        "gemm": [
            {"dtype": d, "m": n, "n": n, "k": n, "seconds": 2 * n**3 / (dev.peak_flops(d) * TRUE_ALONE["fp32"])}
            for d in ("fp32", "bf16")
        ],
        "stream": {"op": "copy", "bytes": 2 * big, "seconds": 2 * big / (dev.hbm_bw * TRUE_ALONE["stream"])},
        "p2p": {"kind": "p2p", "bytes": msg, "seconds": msg / TRUE_ALONE["p2p_bw"] + floor},
    }
    where = {"host": "test", "world_size": 4, "local_world_size": 4, "device_type": "cpu", "backend": "gloo"}
    return {"where": where, "points": points}


def test_fit_recovers_the_figures_that_made_the_points() -> None:
    truth = _truth()
    got = fitting.fit(_record(truth))
    dev, want = got.cluster.device, truth.device
    rel = pytest.approx
    assert dev.eff.gemm_max == rel(1 / TRUE_ALONE["fp32"], rel=1e-3)
    for d in ("fp32", "bf16"):
        assert dev.peak_flops(d) * dev.eff.gemm_max == rel(want.peak_flops(d), rel=1e-3)
        assert dev.peak_flops(d) == rel(want.peak_flops(d) * TRUE_ALONE["fp32"], rel=1e-3)
    assert dev.hbm_bw * dev.eff.mem_max == rel(want.hbm_bw, rel=1e-3)
    assert dev.eff.mem_max == rel(1 / TRUE_ALONE["stream"], rel=1e-3)
    assert dev.eff.launch_s == rel(want.eff.launch_s, rel=1e-3)
    assert dev.eff.gemm_fill_s == rel(want.eff.gemm_fill_s, rel=1e-2)
    assert dev.eff.gemm_k_half == rel(want.eff.gemm_k_half, rel=1e-2)
    assert dev.host_bw == rel(want.host_bw, rel=1e-6)
    assert got.cluster.intra.effective_bw == rel(truth.intra.effective_bw, rel=1e-3)
    assert got.cluster.intra.bw == rel(TRUE_ALONE["p2p_bw"], rel=1e-2)
    assert got.cluster.intra.latency_s == rel(truth.intra.latency_s, rel=1e-3)
    assert dev.eff.collective_base_s == rel(want.eff.collective_base_s, rel=1e-3)
    # NOTE: attention's fractions are of the peak the solo split sets: their products are measured
    for name in ("attn_fwd_max", "attn_bwd_max"):
        assert dev.peak_flops("fp32") * getattr(dev.eff, name) == rel(
            want.peak_flops("fp32") * getattr(want.eff, name), rel=1e-3
        )
    assert got.sources["device.efficiency.attn_bwd_max"].startswith("measured")
    for probe, summary in got.measured["residuals"].items():
        assert summary["max"] < 1e-4, (probe, summary)


def test_a_written_fit_reproduces_its_points_within_the_recorded_residual(tmp_path: Path) -> None:
    record = _record(_truth())
    for i, p in enumerate(record["points"]["gemm"]):  # NOTE: noise the model cannot explain
        p["seconds"] *= 1.0 + 0.2 * math.sin(i)
    out = write_cluster_file(tmp_path / "fit.json", fitting.fit(copy.deepcopy(record)))
    back = read_cluster_file(out)
    check_reproduces(back)
    assert back.measured["residuals"]["gemm"]["max"] > 0.05  # NOTE: the noise shows in the residuals


def check_reproduces(contents: ClusterFile) -> None:
    """Every recorded point, priced on the file's cluster as read back, is its recorded fitted time,
    and sits within the recorded residual of its measured time."""
    cluster, points = contents.cluster, contents.measured["points"]
    prices = {
        "launch": fitting.price_memory(cluster.device),
        "stream": fitting.price_memory(cluster.device),
        "gemm": fitting.price_gemm(cluster.device),
        "collective": fitting.price_collective(cluster),
        "host": fitting.price_host(cluster.device),
        "attention": fitting.price_attention(cluster.device),
    }
    for probe, price in prices.items():
        worst = contents.measured["residuals"][probe].get("max", 0.0)
        for p in points[probe]:
            t = price(p)
            assert t == pytest.approx(p["fitted_s"], rel=1e-12), (probe, p)
            assert abs(t / p["seconds"] - 1.0) <= worst + 1e-12, (probe, p)


# --- the refit from a real trace -----------------------------------------------------------------


def _profiled(path: Path) -> Path:
    from torch.profiler import ProfilerActivity, profile

    mats = [(torch.rand(n, n), torch.rand(n, n)) for n in (64, 128, 256)]
    x, y = torch.zeros(1), torch.rand(64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for a, b in mats * 3:
            torch.mm(a, b)
        for _ in range(40):
            x.add_(1.0)
            torch.mul(y, y)
    prof.export_chrome_trace(str(path))
    return path


def test_refit_from_a_trace_moves_the_rates_towards_it(tmp_path: Path) -> None:
    trace = _profiled(tmp_path / "trace.json")
    start = local_cluster(1)
    for scale, lower in ((1e4, True), (1e-4, False)):
        dev = fitting.with_peaks(start.device, {"fp32": 1e10 * scale})
        dev = fitting.with_figures(dev, launch_s=0.0, hbm_bw=1e13)  # NOTE: no memory floor under the matmuls
        begin = ClusterFile(dataclasses.replace(start, device=dev))
        got, report = refit(begin, trace)
        assert report["events"]["matmul"] == 9 and report["events"]["small op"] >= 80
        assert (got.cluster.device.peak_flops("fp32") < dev.peak_flops("fp32")) is lower
        assert got.cluster.device.eff.launch_s > 0.0
        assert report["residuals_after"]["matmul"]["rms_log"] < report["residuals_before"]["matmul"]["rms_log"]
        assert "9 fp32 matmuls" in got.sources["device.peak.fp32"]


def test_a_trace_without_shapes_is_refused(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(torch.rand(8, 8), torch.rand(8, 8))
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="record_shapes=True"):
        refit(ClusterFile(local_cluster(1)), tmp_path / "t.json")
