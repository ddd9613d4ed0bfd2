"""A rank that stops answering (alive but blocked) surfaces on the others within the module's timeout,
as an error naming the collective, the op and the mesh axis it was waiting on."""

from __future__ import annotations

from meshfold.tools.pool import RankPool

TIMEOUT = 2.0
# NOTE: how late past the timeout the error may come: on a loaded 2-core machine (two test workers,
# eight ranks) a rank's wake-up waits for a core (4.0 s once in the whole suite); without the
# module's timeout the ranks would wait for gloo's own, 30 minutes
SLACK = 4.0


def test_a_stuck_rank_is_named_within_the_timeout() -> None:
    # NOTE: ranks of their own: the task leaves abandoned collectives behind on purpose, and the
    # session's ranks serve every other test
    with RankPool(4) as pool:
        results = pool.run("tests.dist.cases_stuck:stuck_rank", wait=TIMEOUT)
    waiting = [r for rank, r in enumerate(results) if rank != 3]
    for said in waiting:
        message, seconds = said["before a call"]
        assert message.startswith("the call check (an all_reduce over all 4 ranks before each call) did not complete")
        assert "parallelize(..., timeout=)" in message
        assert seconds < TIMEOUT + SLACK, seconds
        message, seconds = said["inside the program"]
        assert seconds < TIMEOUT + SLACK, seconds
        assert "over mesh axis" in message and " did not complete" in message, message
        # NOTE: on gloo all-gathers and reduce-scatters run as all-to-alls (``backends.collectives.issue``)
        called = ("gather_by_all_to_all", "scatter_by_all_to_all", "all_reduce")
        assert message.split(" of ")[0] in called, message
    print(waiting[0]["inside the program"][0])
