"""The ``overlap`` pass on ranks: the same numbers as the program without it, and its collectives run
on gloo's worker threads while the rank computes (``torch.profiler``)."""

from __future__ import annotations

import bisect

from meshfold.passes.options import DEFAULT_PIPELINE
from tests.dist.conftest import RankPools

WITHOUT = ",".join(p for p in DEFAULT_PIPELINE.split(",") if p != "overlap")


def _under_outstanding(r: dict[str, list[tuple[float, float]]]) -> int:
    """Compute kernels that start while some collective the rank issued is not yet waited for."""
    issued = [s for s, _ in r["issues"]]
    waited = sorted(e for _, e in r["waits"])
    return sum(1 for s, _ in r["compute"] if bisect.bisect_right(issued, s) > bisect.bisect_right(waited, s))


def _inside_wire(r: dict[str, list[tuple[float, float]]]) -> int:
    """Compute kernels that ran wholly while a gloo worker thread was running a collective."""
    return sum(1 for s, e in r["compute"] if any(a <= s and e <= b for a, b in r["wire"]))


def test_overlapped_collectives_run_while_the_rank_computes(rank_pools: RankPools) -> None:
    pool = rank_pools.get(4)
    kw = {"hidden": 128, "batch": 8, "seq": 64}
    plain = pool.run("tests.dist.cases_overlap:profiled_step", pipeline=WITHOUT, **kw)
    over = pool.run("tests.dist.cases_overlap:profiled_step", pipeline=DEFAULT_PIPELINE, **kw)
    for a, b in zip(plain, over, strict=True):
        assert a["losses"] == b["losses"]
        assert len(a["issues"]) == len(b["issues"]) > 0
    # NOTE: without the pass every collective is waited for right after it is issued
    assert all(_under_outstanding(r) == 0 for r in plain), [_under_outstanding(r) for r in plain]
    for rank, r in enumerate(over):
        assert _under_outstanding(r) > 5, (rank, _under_outstanding(r))
    # NOTE: a profiled step on 4 ranks sharing 2 cores can, now and then, find one rank's kernels all
    # outside its worker's collectives (the ranks' time slices fell apart): such a rank gets a second step
    again = None
    if any(_inside_wire(r) == 0 for r in over):
        again = pool.run("tests.dist.cases_overlap:profiled_step", pipeline=DEFAULT_PIPELINE, **kw)
    for rank, r in enumerate(over):
        tries = [r] if again is None else [r, again[rank]]
        assert max(_inside_wire(t) for t in tries) > 0, (rank, r["wire"][:5], r["compute"][:5])


def test_chunked_tensor_parallel_matmuls_equal_single_device(rank_pools: RankPools) -> None:
    """``overlap{tp-chunks=2}`` splits every GEMM whose partial result is all-reduced (row-parallel
    projections forward, column-parallel ones' input gradients backward) into two column chunks:
    loss, every gradient and the parameters after AdamW steps still equal single device."""
    chunked = DEFAULT_PIPELINE.replace("overlap", "overlap{tp-chunks=2}")
    for model in ("llama-tiny", "gpt2-tiny"):
        pool = rank_pools.get(4)
        pool.run(
            "tests.dist.cases:equivalence",
            model=model,
            shape=(2, 2),
            names=("dp", "tp"),
            plan="fsdp+tp",
            pipeline=chunked,
        )


def test_chunked_sequence_parallel_matmuls_equal_single_device(rank_pools: RankPools) -> None:
    """Under ``auto`` a wide Llama's MLP runs sequence-parallel: its down projection's partial result is
    reduce-scattered on its rows. ``overlap{tp-chunks=2}`` splits that GEMM into two column chunks,
    each reduce-scattered on its own; loss, gradients and parameters still equal single device."""
    chunked = DEFAULT_PIPELINE.replace("overlap", "overlap{tp-chunks=2}")
    out = rank_pools.get(4).run("tests.dist.cases_overlap:chunked_sequence_parallel", pipeline=chunked)
    # NOTE: two layers, a forward down projection each, two chunks each
    assert all(r["chunked_scatters"] == 4 for r in out), [r["chunked_scatters"] for r in out]
    assert len({tuple(r["losses"]) for r in out}) == 1


def test_nano_batched_sequence_parallel_mlps_equal_single_device(rank_pools: RankPools) -> None:
    """``overlap{nano-batches=2}`` splits each sequence-parallel MLP of a wide Llama under ``auto`` into
    two nano-batches of tokens, each all-gathered and reduce-scattered on its own: loss, every
    gradient and the parameters after AdamW steps still equal single device."""
    nano = DEFAULT_PIPELINE.replace("overlap", "overlap{nano-batches=2}")
    out = rank_pools.get(4).run("tests.dist.cases_overlap:chunked_sequence_parallel", pipeline=nano)
    # NOTE: two layers, a forward MLP each, two nano-batches each
    assert all((r["nano_gathers"], r["nano_scatters"]) == (4, 4) for r in out), out
    assert len({tuple(r["losses"]) for r in out}) == 1
