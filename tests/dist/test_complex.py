"""A model whose rotary embedding multiplies by a complex64 table (torchtitan's Llama3 ``freqs_cis``)
trained on 4 gloo ranks under plans whose programs move that table between ranks: FSDP + TP, with
activations offloaded, context parallel beside FSDP (ring attention, TokenRing), and compiled by
Inductor. Loss and every gradient equal one device's. gloo's collectives take no complex
tensor (its all-to-all, which gloo's all-gathers are sent as, least of all): ``backends/collectives.py`` sends
complex values as real views (``tests/dist/test_dtypes.py`` checks every collective on every dtype)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist.conftest import RankPools

TP = ((2, 2), ("dp", "tp"), "fsdp+tp")
CP = ((2, 2), ("dp", "cp"), "fsdp+cp")
# NOTE: (id, mesh and plan, options, what the program must hold for the case to mean something)
CASES: list[tuple[str, tuple[Any, ...], dict[str, Any], str]] = [
    ("fsdp+tp", TP, {}, "comm.all_gather"),
    ("offload", TP, {"memory": "offload"}, "mem.offload"),
    ("cp-ring", CP, {"cp": {"method": "ring"}}, "1 ring attentions"),
    ("cp-tokenring", CP, {"cp": {"method": "tokenring"}}, "1 TokenRing attentions"),
    ("inductor", TP, {"backend": "inductor"}, "comm.all_gather"),
]


@pytest.mark.parametrize(("plan", "options", "holds"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_complex_rotary_table_trains_as_one_device(
    rank_pools: RankPools, plan: tuple[Any, ...], options: dict[str, Any], holds: str
) -> None:
    shape, names, name = plan
    out = rank_pools.get(4).run(
        "tests.dist.cases_complex:rope_equivalence", shape=shape, names=names, plan=name, **options
    )
    for rank, r in enumerate(out):
        # NOTE: the complex table crosses ranks (else the case tests nothing), in the program asked for
        assert r["complex_moved"], (rank, r)
        assert holds in r["own_ops"] or any(holds in line for line in r["report"]), (rank, r)
        if options.get("backend") == "inductor":
            assert [(what.split("'s ")[1], calls) for what, calls in r["compiled"]] == [
                ("forward program", 1),
                ("backward program", 1),
            ], r["compiled"]
