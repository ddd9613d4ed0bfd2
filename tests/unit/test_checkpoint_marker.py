"""Which checkpoint a restart loads: only a folder whose write completed (``COMPLETE.json``), the newest;
and the error a fixed plan gives when the world it shrank to no longer fits its mesh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshfold.elastic import mesh_for
from meshfold.passes import PassError
from meshfold.runtime.checkpoint import MARKER, folder, latest


def _complete(root: Path, step: int, world: int = 4) -> Path:
    path = folder(root, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    (path / MARKER).write_text(json.dumps({"step": step, "world": world, "mesh": [["dp", world]], "written": 0.0}))
    return path


def test_latest_is_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    _complete(tmp_path, 3)
    _complete(tmp_path, 6, world=3)
    saved = latest(tmp_path)
    assert saved is not None
    assert (saved.step, saved.world, saved.mesh, saved.path) == (6, 3, (("dp", 3),), folder(tmp_path, 6))


def test_a_write_cut_short_is_never_answered(tmp_path: Path) -> None:
    _complete(tmp_path, 3)
    cut = folder(tmp_path, 9)  # NOTE: every rank's shards and DCP's metadata, but no marker
    cut.mkdir()
    (cut / ".metadata").write_bytes(b"x")
    (cut / "__0_0.distcp").write_bytes(b"x")
    (cut / f".{MARKER}.tmp").write_text("{")  # NOTE: the marker's own write, cut short before its rename
    assert latest(tmp_path).step == 3  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "text",
    ["{", json.dumps({"step": 8, "world": 4, "mesh": [["dp", 4]]}), json.dumps({"world": 4}), json.dumps([1, 2])],
    ids=["truncated", "another-step", "no-step", "not-a-dict"],
)
def test_a_marker_that_is_not_ours_is_skipped(tmp_path: Path, text: str) -> None:
    _complete(tmp_path, 3)
    odd = folder(tmp_path, 9)
    odd.mkdir()
    (odd / MARKER).write_text(text)
    assert latest(tmp_path).step == 3  # type: ignore[union-attr]


def test_nothing_to_resume(tmp_path: Path) -> None:
    assert latest(tmp_path / "absent") is None
    (tmp_path / "step-12").mkdir()  # NOTE: not our folder name
    (tmp_path / "step-12" / MARKER).write_text(json.dumps({"step": 12, "world": 1, "mesh": []}))
    assert latest(tmp_path) is None


def test_a_fixed_mesh_keeps_its_axes_and_dp_takes_the_rest() -> None:
    assert mesh_for(4, {"tp": 2}) == (("dp", "tp"), (2, 2))
    assert mesh_for(3, {}) == (("dp",), (3,))


def test_a_fixed_mesh_that_no_longer_fits_names_what() -> None:
    with pytest.raises(PassError, match=r"tp=2.*3 ranks there are now.*plan='auto'"):
        mesh_for(3, {"tp": 2})
