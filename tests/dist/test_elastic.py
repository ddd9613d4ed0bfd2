"""A run that loses ranks goes on on the ranks left: 4 local torchrun agents (one rank each, joined by
a c10d rendezvous) train llama-tiny under ``meshfold.train``; one node is killed (SIGKILL) at a random
step, then another hangs (SIGSTOP). Each time the survivors detect it, torchrun restarts them,
``plan="auto"`` plans for the smaller world and the newest complete checkpoint is loaded resharded.
Every loss logged, before and after each restart, equals the single-device model's uninterrupted run;
a checkpoint folder left without its marker is never the one loaded."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from meshfold.runtime.checkpoint import MARKER, folder, latest
from meshfold.tools.local_agents import Loss, lose_nodes, recoveries, reference_losses

STEPS, EVERY, TIMEOUT_S, LR = 15, 3, 10.0, 1e-2


def _plant_cut_write(checkpoints: Path, planted: list[int]) -> None:
    """A copy of the newest complete checkpoint one step later, without its marker: loading it would
    resume at the wrong step with the right-looking files."""
    newest = latest(checkpoints)
    assert newest is not None
    cut = folder(checkpoints, newest.step + 1)
    shutil.copytree(newest.path, cut)
    (cut / MARKER).unlink()
    planted.append(newest.step + 1)


@pytest.mark.timeout(600)
def test_a_killed_then_a_hung_node_resume_on_fewer_ranks_as_one_device_trains(tmp_path: Path) -> None:
    rng = random.Random()
    kill_after, stop_after = rng.randrange(3, 6), rng.randrange(8, 10)
    losses = [Loss("kill", 4, kill_after, rng.randrange(4)), Loss("stop", 3, stop_after, rng.randrange(3))]
    planted: list[int] = []
    outcome = lose_nodes(
        tmp_path,
        losses,
        steps=STEPS,
        every=EVERY,
        timeout_s=TIMEOUT_S,
        lr=LR,
        after_loss=lambda ck: _plant_cut_write(ck, planted),
    )
    said = f"losses {losses}, events in {tmp_path}"
    assert outcome.codes and all(c == 0 for c in outcome.codes.values()), (outcome.codes, said)
    resumed = [e for e in outcome.events if e["event"] == "resumed" and e["rank"] == 0]
    assert [e["world"] for e in resumed] == [4, 3, 2], said
    assert resumed[0]["step"] == 0
    # NOTE: each restart loads the newest complete checkpoint before the loss, never the planted folder
    for e, at, cut in zip(resumed[1:], outcome.lost_at, planted, strict=True):
        written = [c["step"] for c in outcome.events if c["event"] == "checkpoint" and c["t"] < at]
        assert e["step"] not in planted and e["step"] % EVERY == 0 and e["step"] < cut, (e, planted, said)
        assert e["step"] >= max(written, default=0) - EVERY, (e, written, said)
    ref = reference_losses("llama-tiny", STEPS, LR)
    steps = [e for e in outcome.events if e["event"] == "step"]
    assert {e["step"] for e in steps if e["world"] == 2} >= set(range(resumed[2]["step"], STEPS)), said
    for e in steps:
        assert abs(e["loss"] - ref[e["step"]]) <= 1e-5 + 1e-4 * abs(ref[e["step"]]), (e, ref[e["step"]], said)
    for r in recoveries(outcome):
        assert 0 <= r["steps_lost"] <= EVERY, (r, said)
        assert r["detect_s"] <= TIMEOUT_S + 10, (r, said)
    (tmp_path / "recoveries.json").write_text(json.dumps(recoveries(outcome)))
