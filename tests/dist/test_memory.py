"""The liveness estimate of one rank's memory (``passes.cost.liveness``) against the peak tensor memory
the CPU allocator reports on real gloo ranks, for plans that keep, shard and bucket differently."""

from __future__ import annotations

import threading

import pytest
import torch

from meshfold.tools.measure import peak_new_bytes
from tests.dist.conftest import RankPools

# NOTE: hidden 128, batch 8 x seq 64 makes activations about as large as parameters + AdamW state,
# so both halves of the estimate matter.
CASES = [((4,), ("dp",), "ddp"), ((4,), ("dp",), "fsdp"), ((2, 2), ("dp", "tp"), "fsdp+tp")]


# NOTE: measured 1.000 / 0.912-0.977 / 0.995-1.008 (estimate / measured, by rank) with the overlap pass's
# schedule, once the measurement counts frees made on gloo's worker threads (``allocator_accounting``).
@pytest.mark.parametrize("case", CASES, ids=[c[2] for c in CASES])
def test_estimate_within_ten_percent_of_measured_peak(
    rank_pools: RankPools, case: tuple[tuple[int, ...], tuple[str, ...], str]
) -> None:
    shape, names, plan = case
    results = rank_pools.get(4).run(
        "tests.dist.cases_memory:step_memory", shape=shape, names=names, plan=plan, hidden=128, batch=8, seq=64
    )
    for rank, r in enumerate(results):
        assert r["resident_estimated"] == r["resident_measured"], f"rank {rank}: {r}"
        transient = r["measured"] - r["resident_measured"]
        assert transient > 0.5 * r["resident_measured"], f"rank {rank}: activations too small to test: {r}"
        err = abs(r["estimated"] - r["measured"]) / r["measured"]
        assert err <= 0.10, f"rank {rank}: estimate {r['estimated']} vs measured {r['measured']} ({err:.1%}); {r}"


def test_peak_counts_frees_made_on_other_threads() -> None:
    """A collective's buffers are often freed by a gloo worker thread, which the profiler does not
    follow; the measured peak must still see them go. Here a 1 MiB block is dropped on another thread
    before a second one is allocated: the peak is 1 MiB, not 2."""
    mib = 1 << 20

    def step() -> None:
        box = [torch.empty(mib, dtype=torch.uint8)]
        worker = threading.Thread(target=box.clear)
        worker.start()
        worker.join()
        assert not box
        again = torch.empty(mib, dtype=torch.uint8)
        del again

    assert peak_new_bytes(step) == mib
