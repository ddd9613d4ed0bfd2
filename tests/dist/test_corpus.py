"""The differential corpus on ranks: the fixed slice of the matrix CI runs (``meshfold corpus --slice
ci``), each cell against the single-device model, and what a training loop does besides one backward."""

from __future__ import annotations

import pytest

from meshfold.tools.corpus import columns as plans
from meshfold.tools.corpus import entries as corpus_entries
from meshfold.tools.corpus import matrix
from meshfold.tools.corpus.slice import CI_SLICE, REFUSED
from tests.dist.conftest import RankPools


@pytest.mark.parametrize("cell", CI_SLICE, ids=[f"{e}:{c}" for e, c in CI_SLICE])
def test_corpus_slice_cell_equals_single_device(rank_pools: RankPools, cell: tuple[str, str]) -> None:
    entry, column = corpus_entries.get(cell[0]), plans.column(cell[1])
    got = matrix.run_cell(rank_pools.get(plans.WORLD), entry, column)
    assert got.status == "equal", f"{got.key}: {got.status}: {got.message}\n{got.log}"


@pytest.mark.parametrize("cell", REFUSED, ids=[f"{e}:{c}" for e, c, _ in REFUSED])
def test_corpus_cells_a_plan_cannot_run_are_refused_naming_why(
    rank_pools: RankPools, cell: tuple[str, str, str]
) -> None:
    """A plan that cannot equal one device says so on every rank before any collective of a program:
    dropout under a pipeline (each microbatch would draw its own mask), BatchNorm's running statistics
    under a pipeline (each microbatch would update them)."""
    entry, column = corpus_entries.get(cell[0]), plans.column(cell[1])
    got = matrix.run_cell(rank_pools.get(plans.WORLD), entry, column)
    assert got.status == "refused" and cell[2] in got.message, f"{got.key}: {got.status}: {got.message}\n{got.log}"


@pytest.mark.parametrize(
    "case",
    [("hf-gpt-neox", (4,), ("dp",), "ddp"), ("hf-phi", (2, 2), ("dp", "tp"), "fsdp+tp")],
    ids=["gpt-neox-ddp", "phi-fsdp+tp"],
)
def test_accumulated_and_clipped_gradients_equal_single_device(rank_pools: RankPools, case: tuple) -> None:
    """A parallel-residual block's two output biases get one gradient sum; accumulated over two
    backward calls and clipped in place, each stays its own."""
    entry, shape, names, plan = case
    worst = rank_pools.get(4).run(
        "tests.dist.cases_corpus:accumulated_and_clipped", entry=entry, shape=shape, names=names, plan=plan
    )
    assert max(worst) < 1e-4


@pytest.mark.parametrize(
    "case",
    [
        ("hf-llama", (4,), ("dp",), "ddp", ["{}", "{dp: S(0)}", "{}"]),
        ("hf-gpt-neox", (4,), ("dp",), "fsdp", ["{}", "{}", "{dp: S(0)}"]),
        ("hf-llama", (2, 2), ("dp", "tp"), "fsdp+tp", ["{dp: S(0)}", "{dp: S(0)}", "{}"]),
        ("hf-llama", (2, 2), ("dp", "fsdp"), "ddp+fsdp", ["{dp: S(0)}", "{dp: S(0), fsdp: S(0)}", "{}"]),
    ],
    ids=["ddp", "fsdp", "fsdp+tp", "ddp+fsdp"],
)
def test_a_batch_the_data_parallel_ranks_do_not_divide_trains_equal_to_single_device(
    rank_pools: RankPools, case: tuple
) -> None:
    """The last batch of an epoch (a DataLoader's default ``drop_last=False``): the batch is split over
    the data-parallel axes whose ranks divide it and computed whole on the others, equal to one device."""
    entry, shape, names, plan, layouts = case
    batches = (6, 8, 5) if plan != "fsdp" else (7, 5, 4)
    got = rank_pools.get(4).run(
        "tests.dist.cases_corpus:uneven_batches", entry=entry, shape=shape, names=names, plan=plan, batches=batches
    )
    assert all(g == got[0] for g in got), got
    assert got[0] == layouts, got[0]
