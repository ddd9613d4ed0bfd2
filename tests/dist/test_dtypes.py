"""Every dtype the IR holds through every ``comm.*`` op (``backends/collectives.py``) on gloo ranks: in gloo's
forms (all-gathers and sum reduce-scatters sent as all-to-alls) and in the forms NCCL and HCCL run,
eagerly, compiled by Inductor and traced for Ascend's GE graph mode (run on CPU), each result equal to
what the collective must give. Complex values cross as real views (gloo's and NCCL's collectives take
none); reductions that mean nothing on a dtype are refused when the program is verified and lowered,
before any collective runs."""

from __future__ import annotations

import pytest

from tests.dist.conftest import RankPools

DTYPES = ("f32", "bf16", "f16", "f64", "i64", "i32", "i8", "u8", "b8", "c64", "c128", "c32", "f8e4m3fn", "f8e5m2")
"""The IR's dtypes (``ir.types.DTYPE_NAMES``) but the fnuz float8 ones, i16 and the unsigned integers wider
than 8 bits, which gloo takes in no collective; float8 values cross as their bytes, and are never reduced."""
OPS = ("ag0", "ag1", "a2a01", "a2a10", "shift", "zigzag", "agb0", "agb1", "shard")
"""What every dtype goes through (``cases_dtypes._program``): all-gathers along dims 0 and 1 (the first
started and waited on later), all-to-alls both ways, permutes (a ring's shift, the zigzag split), a
bucketed all-gather, a local shard."""
SUMS = ("ar", "rs0", "rs1", "arb0", "arb1", "rsb0", "rsb1", "partial")
"""Sums: all-reduce, reduce-scatters along dims 0 and 1 (one started), bucketed all-reduce and
reduce-scatter (started), and a Replicate value made a Partial."""
MEANS = ("avg", "avgs", "avgb0", "avgb1")
MAXIMA = ("max", "maxs")


def _expected_outputs(names: tuple[str, ...]) -> list[str]:
    """Each output the program must have for ``names``: sums but of bools, means of floating-point and
    complex values, maxima but of complex ones (``ir.placement.reduce_refusal``)."""
    out = []
    for d in names:
        if d.startswith("f8"):  # NOTE: float8 is moved, never reduced
            out += [f"{k}_{d}" for k in OPS]
            continue
        kinds = OPS + (SUMS if d != "b8" else ())
        kinds += MEANS if d[0] in "fbc" and d != "b8" else ()
        kinds += MAXIMA if d[0] != "c" else ()
        out += [f"{k}_{d}" for k in kinds]
    return sorted(out)


@pytest.mark.parametrize(
    ("backend", "gloo"), [("eager", True), ("eager", False), ("ascend", False)], ids=["gloo", "nccl", "ascend"]
)
def test_every_dtype_crosses_every_collective(rank_pools: RankPools, backend: str, gloo: bool) -> None:
    # NOTE: torchair has no converter for a float8 value's byte view (aten.view.dtype): the ascend
    # backend refuses such a program, naming the node, before it runs
    names = tuple(d for d in DTYPES if backend != "ascend" or not d.startswith("f8"))
    out = rank_pools.get(4).run("tests.dist.cases_dtypes:collectives", names=names, backend=backend, gloo=gloo)
    for rank, r in enumerate(out):
        assert r["compared"] == _expected_outputs(names), rank
        assert not r["wrong"], (rank, r["wrong"])
        assert not r["missized"], (rank, r["missized"])


def test_complex_collectives_compiled_by_inductor(rank_pools: RankPools) -> None:
    """Inductor compiles the complex values' real views around every collective, in gloo's forms and
    NCCL's (complex64 only: a program of every dtype takes Inductor over a minute on 2 cores, and the
    other dtypes' lowering is the eager one's, complex128's complex64's with float64 parts)."""
    for gloo in (True, False):
        out = rank_pools.get(2).run(
            "tests.dist.cases_dtypes:collectives", names=("c64",), backend="inductor", gloo=gloo
        )
        for rank, r in enumerate(out):
            assert r["compared"] == _expected_outputs(("c64",)), rank
            assert not r["wrong"], (gloo, rank, r["wrong"])


def test_point_to_point_and_host_tier_keep_every_dtype(rank_pools: RankPools) -> None:
    """Ring attention's and TokenRing's pass to the next rank (``backends/context_parallel/p2p.py``), the zigzag
    reshuffle (``ring_lowering.to_zigzag``) and an offload's round trip through the host tier."""
    out = rank_pools.get(4).run("tests.dist.cases_dtypes:point_to_point", names=DTYPES)
    assert out == [[]] * 4, out


REFUSED = [
    ("b8", "sum", "a sum of bools is no bool"),
    ("b8", "avg", "a mean of integers or bools"),
    ("i64", "avg", "a mean of integers or bools"),
    ("i32", "avg", "a mean of integers or bools"),
    ("c64", "max", "complex numbers have no order"),
    ("c128", "max", "complex numbers have no order"),
]


@pytest.mark.parametrize(("dtype", "reduce", "why"), REFUSED, ids=[f"{d}-{r}" for d, r, _ in REFUSED])
def test_meaningless_reductions_are_refused_before_any_collective(
    rank_pools: RankPools, dtype: str, reduce: str, why: str
) -> None:
    """Each comm op that reduces, on a dtype its reduction means nothing on: the verifier (the default
    pipeline's last pass) and the lowering both refuse it, naming the op, its module path and the value,
    and no rank has issued a collective."""
    out = rank_pools.get(4).run("tests.dist.cases_dtypes:refused", name=dtype, reduce=reduce)
    for rank, r in enumerate(out):
        assert r["issued"] == 0, rank
        assert sorted(r["errors"]) == ["all_reduce", "all_reduce_bucket", "reduce_scatter", "reduce_scatter_bucket"]
        for kind, (verified, lowered) in r["errors"].items():
            for message in (verified, lowered):
                assert f"comm.{kind} at layers.0.attn (fwd)" in message, message
                assert f"(reduce={reduce!r}) of %p: {dtype}[8, 12]: {why}" in message, message
