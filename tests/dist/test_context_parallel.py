"""``plan="cp"``: each input's sequence split over a ``cp`` mesh axis (alone, with tensor parallelism,
with FSDP), trained on gloo ranks: loss, every gradient and the parameters after AdamW steps equal
single device."""

from __future__ import annotations

from typing import Any

import pytest

from meshfold import DEFAULT_PIPELINE
from tests.dist.conftest import RankPools

# NOTE: (model, mesh shape, axis names, plan); gpt2-tiny's 2 sequences over 4 ranks: attention split
# by heads (Ulysses); llama-tiny's over 2: by batch; with fsdp on dp the cp axis splits the heads;
# llama-tiny over 4 (2 key/value heads): the solve finds no plan and the greedy choice it falls back
# to (with a warning) splits the heads after the keys' repeat
CASES = [
    ("llama-tiny", (2,), ("cp",), "cp"),
    ("llama-tiny", (2, 2), ("cp", "tp"), "cp+tp"),
    ("llama-tiny", (2, 2), ("dp", "cp"), "fsdp+cp"),
    ("gpt2-tiny", (4,), ("cp",), "cp"),
    ("llama-tiny", (4,), ("cp",), "cp"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{p}-{'x'.join(map(str, s))}" for m, s, _, p in CASES])
def test_context_parallel_equals_single_device(
    rank_pools: RankPools, case: tuple[str, tuple[int, ...], tuple[str, ...], str]
) -> None:
    model, shape, names, plan = case
    world = 1
    for n in shape:
        world *= n
    rank_pools.get(world).run("tests.dist.cases:equivalence", model=model, shape=shape, names=names, plan=plan)


# NOTE: (model, mesh shape, axis names, plan, cp method, tokens, float64, moe); one sequence where only the
# sequence splits: hf-llama (grouped-query, a causal mask tensor) and hf-mistral-window (a sliding-window
# mask: blocks it hides whole are skipped) run their attention as ring attention; llama-tiny calls the
# kernel causal (no mask) and, in float32, differs from one device by rounding only, so it runs in
# float64; ulysses on hf-llama splits the 4 heads over 4 ranks instead, and auto prices ring attention
# cheaper (no all-to-all); hf-mixtral's experts fold over the ranks the ring runs on (ep=4 over cp, and
# over fsdp x cp); plan="auto" on one sequence of 2048 chooses the sequence split and ring attention
# itself; on 8 ranks ring attention over cp=4 beside tp=2; TokenRing with a mask and with the kernel's
# causal flag;
# hf-llama-padded: a padding mask beside the causal one (a sequence padded on the left: its first rows
# see no key at all; one on the right), ring attention and TokenRing, float64; hf-llama-eager: HF's eager
# attention (softmax(QKᵀ)V written out), fused at capture and split by sequence like the others;
# llama-tiny's ring attention as steps (no mask tensor) beside fsdp, and on 8 ranks beside tp
RING_CASES = [
    ("hf-llama", (4,), ("cp",), "cp", "ring", (1, 32), False, None),
    ("hf-llama", (2, 2), ("cp", "tp"), "cp+tp", "ring", (1, 32), False, None),
    ("hf-llama", (2, 2), ("dp", "cp"), "fsdp+cp", "ring", (2, 32), False, None),
    ("hf-mistral-window", (4,), ("cp",), "cp", "ring", (1, 32), False, None),
    ("llama-tiny", (4,), ("cp",), "cp", "ring", (1, 32), True, None),
    ("hf-llama", (4,), ("cp",), "cp", "ulysses", (1, 32), False, None),
    ("hf-llama", (4,), ("cp",), "cp", "auto", (1, 32), False, None),
    ("hf-mixtral", (4,), ("cp",), "cp", "ring", (2, 32), False, {"ep": 4}),
    ("hf-mixtral", (2, 2), ("dp", "cp"), "fsdp+cp", "ring", (2, 32), False, {"ep": 4}),
    ("hf-llama", (4,), ("cp",), "auto", None, (1, 2048), False, None),
    ("hf-llama", (4, 2), ("cp", "tp"), "cp+tp", "ring", (1, 64), False, None),
    ("hf-llama", (4,), ("cp",), "cp", "tokenring", (1, 32), False, None),
    ("llama-tiny", (2, 2), ("cp", "tp"), "cp+tp", "tokenring", (1, 32), True, None),
    ("hf-llama-padded", (4,), ("cp",), "cp", "ring", None, True, None),
    ("hf-llama-padded", (4,), ("cp",), "cp", "tokenring", None, True, None),
    ("hf-llama-eager", (4,), ("cp",), "cp", "ring", (1, 32), False, None),
    ("hf-llama-eager", (2, 2), ("cp", "tp"), "cp+tp", "tokenring", (1, 32), False, None),
    ("llama-tiny", (2, 2), ("dp", "cp"), "fsdp+cp", "ring", (2, 32), True, None),
    ("llama-tiny", (4, 2), ("cp", "tp"), "cp+tp", "ring", (1, 32), True, None),
]
SPLIT = {"ring": "sequence", "tokenring": "sequence", "auto": "sequence", "ulysses": "heads", None: "sequence"}


@pytest.mark.parametrize(
    "case",
    RING_CASES,
    ids=[f"{c[0]}-{c[3]}-{'x'.join(map(str, c[1]))}-{c[4]}" + ("-ep4" if c[7] else "") for c in RING_CASES],
)
def test_cp_method_equals_single_device(rank_pools: RankPools, case: tuple[Any, ...]) -> None:
    """``cp={"method": ...}``: every forward attention reads its queries split the way the method says on
    the cp axis, the kernel the method names sends the point-to-point messages (none under Ulysses), and the
    program equals single device."""
    model, shape, names, plan, method, tokens, double, moe = case
    world = 1
    for n in shape:
        world *= n
    results = rank_pools.get(world).run(
        "tests.dist.cases_ring:compiled_attention",
        model=model,
        shape=shape,
        names=names,
        plan=plan,
        cp=method,
        tokens=tokens,
        double=double,
        moe=moe,
    )
    kernel = {"ulysses": set(), "tokenring": {"tokenring.py"}}.get(method, {"ring_attention.py"})
    # NOTE: ring attention and TokenRing with no mask tensor are written out as their steps
    # (passes/cp/steps.py): the keys (the queries and results) travel by comm.ppermute ops of the
    # program, not from inside a kernel
    steps = method in ("ring", "tokenring") and model == "llama-tiny"
    cp = dict(zip(names, shape, strict=True))["cp"]
    for r in results:
        assert r["attention"], "no attention in the compiled program"
        assert all(s["cp"] == SPLIT[method] for s in r["attention"]), r["attention"]
        if steps:
            layers = len(r["attention"])
            # NOTE: per layer forward: cp steps; q, k, v to the zigzag split, per step after the first the
            # keys and values on (ring) or the queries there and output and lse back (TokenRing), out and lse home
            per_step = 3 if method == "tokenring" else 2
            assert r["ring_steps"]["fwd"] == (cp * layers, (3 + per_step * (cp - 1) + 2) * layers), r["ring_steps"]
            assert r["ring_steps"]["bwd"][0] == cp * layers, r["ring_steps"]
            assert set(r["senders"]) == set(), r["senders"]
        else:
            assert r["ring_steps"] == {"fwd": (0, 0), "bwd": (0, 0)}, r["ring_steps"]
            assert set(r["senders"]) - {"ring_lowering.py"} == kernel, r["senders"]


@pytest.mark.parametrize("model", ["hybrid-tiny", "hybrid-gated-tiny"])
@pytest.mark.parametrize("mode", ["solve", "greedy"])
def test_hybrid_linear_and_softmax_attention_equal_single_device(rank_pools: RankPools, mode: str, model: str) -> None:
    """hybrid-tiny (a linear-attention layer, its state a running sum along the sequence, then a softmax
    layer) under cp=4, float64: ring attention for the softmax layer; the solve splits the linear layer's
    state by its value dim (no traffic; its key normaliser it computes whole), the greedy choice keeps the
    forward running sums split along the sequence (each rank adds the totals of the ranks before it: one
    all-gather of the memory states); both equal single device. hybrid-gated-tiny: the memory decays by a
    gate per head and token, one more running sum (of the log-gates, a few numbers per token: both keep it
    whole) in the forward; the decayed states split along the sequence the same way."""
    pipeline = None if mode == "solve" else DEFAULT_PIPELINE.replace("sharding", "sharding{mode=greedy}")
    results = rank_pools.get(4).run(
        "tests.dist.cases_ring:compiled_attention",
        model=model,
        shape=(4,),
        names=("cp",),
        plan="cp",
        cp="ring",
        tokens=(1, 64),
        double=True,
        pipeline=pipeline,
    )
    for r in results:
        assert [s["cp"] for s in r["attention"]] == ["sequence"], r["attention"]
        forward = [placement for phase, dim, placement in r["scans"] if phase == "fwd"]
        assert len(forward) == (3 if "gated" in model else 2), r["scans"]
        assert ("S(2)" in forward) == (mode == "greedy"), r["scans"]  # NOTE: a running sum along the sequence


def _packed(
    rank_pools: RankPools,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    split_above: int | None,
    method: str = "ring",
) -> Any:
    world = 1
    for n in shape:
        world *= n
    plan = "+".join(n for n in names)
    return rank_pools.get(world).run(
        "tests.dist.cases_ring:packed_attention",
        shape=shape,
        names=names,
        plan=plan,
        split_above=split_above,
        method=method,
    )


def test_packed_sequences_equal_single_device(rank_pools: RankPools) -> None:
    """hf-llama-packed's nine sequences (40 to 2 tokens) packed in one row of 96 for 4 cp ranks
    (``meshfold.packing``), under ring attention: with per-sequence degrees (the long ones split over
    the ranks, the short ones whole on one) and with one fixed degree (``split_above=0``: every
    sequence split), both equal one device given the sequences in order; ring attention sends only
    what other ranks' queries see, so the per-sequence degrees send less."""
    per_sequence = _packed(rank_pools, (4,), ("cp",), None)
    fixed = _packed(rank_pools, (4,), ("cp",), 0)
    assert set(per_sequence[0]["degrees"]) == {1, 4}, per_sequence[0]["degrees"]
    assert set(fixed[0]["degrees"]) == {4}, fixed[0]["degrees"]
    assert all(r["sent"] > 0 for r in per_sequence)
    mine, theirs = sum(r["sent"] for r in per_sequence), sum(r["sent"] for r in fixed)
    assert mine < 0.8 * theirs, (mine, theirs)
    # NOTE: both layers read one mask, forward and backward: one gather of where it reaches per step
    assert all(r["reaches"] == 1 for r in per_sequence + fixed), [r["reaches"] for r in per_sequence]


def test_packed_sequences_with_tensor_parallel_equal_single_device(rank_pools: RankPools) -> None:
    """The packed row for 2 cp ranks beside tp=2 equals one device too."""
    results = _packed(rank_pools, (2, 2), ("cp", "tp"), None)
    assert set(results[0]["degrees"]) == {1, 2}, results[0]["degrees"]


def test_packed_sequences_under_tokenring_equal_single_device(rank_pools: RankPools) -> None:
    """The packed row under TokenRing: a rank's query rows travel only to the ranks whose keys they see
    (the split sequences' rows), so per-sequence degrees send less than one fixed degree here too; both
    equal one device on the sequences in order."""
    per_sequence = _packed(rank_pools, (4,), ("cp",), None, "tokenring")
    fixed = _packed(rank_pools, (4,), ("cp",), 0, "tokenring")
    mine, theirs = sum(r["sent"] for r in per_sequence), sum(r["sent"] for r in fixed)
    assert 0 < mine < 0.8 * theirs, (mine, theirs)


@pytest.mark.parametrize("world", [2, 4])
def test_running_sum_and_flip_split_by_sequence_equal_the_whole(rank_pools: RankPools, world: int) -> None:
    """``cumsum`` and ``flip`` along a dim split over 2 and 4 ranks give each rank its part of the
    whole tensor's, and trace for Inductor to ATen ops and functional collectives
    (``cases_ring.split_scans`` checks both on every rank)."""
    assert rank_pools.get(world).run("tests.dist.cases_ring:split_scans", seq=8) == [True] * world


@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_recurrence_split_by_steps_equals_the_whole_scan(rank_pools: RankPools, world: int, diagonal: bool) -> None:
    """``affine_scan`` (a matrix on the left, or element by element) with its 8 steps split over 2 and 4
    ranks (one all-gather of each rank's composite step; the backward from the last rank down): every
    rank's states, ``dm`` and ``db`` are the whole scan's, and the ranks' ``ds0`` add up to its."""
    for r in rank_pools.get(world).run("tests.dist.cases_ring:split_recurrence", steps=8, diagonal=diagonal):
        assert r["scale"] > 1.0, r
        assert max(r["h"], r["dm"], r["db"], r["ds0"]) < 1e-10, r


def _on_cp(
    rank_pools: RankPools, model: str, world: int, tokens: int, mode: str, mesh: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """``cases_ring.compiled_attention`` of ``model`` on one sequence of ``tokens`` split over ``cp`` of
    ``world`` ranks (or over ``mesh``, axis sizes by name: its plan the axes joined by ``+``, fsdp for
    ``dp``, with two sequences), float64, under the solve or the greedy choice (``mode``)."""
    mesh = mesh or {"cp": world}
    pipeline = None if mode == "solve" else DEFAULT_PIPELINE.replace("sharding", "sharding{mode=greedy}")
    results: list[dict[str, Any]] = rank_pools.get(world).run(
        "tests.dist.cases_ring:compiled_attention",
        model=model,
        shape=tuple(mesh.values()),
        names=tuple(mesh),
        plan="+".join("fsdp" if a == "dp" else a for a in mesh),
        cp="ring",
        tokens=(2 if "dp" in mesh else 1, tokens),
        double=True,
        pipeline=pipeline,
    )
    return results


@pytest.mark.hf
@pytest.mark.parametrize(("world", "mode"), [(2, "solve"), (4, "greedy")])
def test_qwen3_next_gated_deltanet_equals_single_device(rank_pools: RankPools, world: int, mode: str) -> None:
    """hf-qwen3-next (a gated DeltaNet layer, its chunked delta rule captured as one linear recurrence
    over chunks, then a softmax-attention layer) under cp, float64, one sequence of 64 tokens per rank:
    the softmax layer runs ring attention, the recurrence is split as the sharding chooses (by heads
    or state columns: no traffic); loss, every gradient and the parameters after AdamW steps equal
    single device."""
    results = _on_cp(rank_pools, "hf-qwen3-next", world, 64 * world, mode)
    for r in results:
        assert [s["cp"] for s in r["attention"]] == ["sequence"], r["attention"]
        assert [phase for phase, _ in r["recurrences"]] == ["fwd", "bwd"], r["recurrences"]


def test_chunked_delta_rule_split_by_chunks_equals_single_device(rank_pools: RankPools) -> None:
    """delta-tiny (a chunked gated delta rule, one head, value dim 6: nothing but the chunks to split on
    4 ranks) under cp=4 with the greedy choice, float64: the recurrence's steps split over ``cp`` (one
    all-gather of each rank's composite step, forward and backward); loss, every gradient and the
    parameters after AdamW steps equal single device."""
    results = _on_cp(rank_pools, "delta-tiny", 4, 32, "greedy")
    for r in results:
        assert r["recurrences"] == [("fwd", {"cp": "S(1)"}), ("bwd", {"cp": "S(1)"})], r["recurrences"]


@pytest.mark.hf
def test_mamba_selective_scan_equals_single_device(rank_pools: RankPools) -> None:
    """hf-mamba (two layers, each a short causal convolution, then a selective state-space scan HF runs
    token by token, captured as one element-by-element recurrence over the tokens) under cp=4 with the
    greedy choice, float64: the sequence stays split through both (each convolution takes 3 positions
    from the rank before, each scan one all-gather of the ranks' composite steps), forward and
    backward; loss, every gradient and the parameters after AdamW steps equal single device."""
    results = _on_cp(rank_pools, "hf-mamba", 4, 32, "greedy")
    for r in results:
        assert r["recurrences"] == [(p, {"cp": "S(1)"}) for p in ("fwd", "fwd", "bwd", "bwd")], r["recurrences"]
        assert r["convolutions"] == [(p, {"cp": "S(2)"}) for p in ("fwd", "fwd", "bwd", "bwd")], r["convolutions"]


@pytest.mark.parametrize("world", [2, 4])
def test_causal_conv_split_by_sequence_equals_one_device(rank_pools: RankPools, world: int) -> None:
    """``causal_conv1d`` with 16 positions split over 2 and 4 ranks (each takes the 3 positions before
    its part from the rank before; the backward, the 3 gradient positions after it from the rank
    after): every rank's output and ``dx`` are one device's, and the ranks' ``dw`` and ``dbias`` add
    up to its."""
    for r in rank_pools.get(world).run("tests.dist.cases_ring:split_conv", length=16):
        assert max(r.values()) < 1e-12, r


@pytest.mark.hf
@pytest.mark.parametrize("mesh", [{"cp": 2, "tp": 2}, {"dp": 2, "cp": 2}], ids=["cp+tp", "fsdp+cp"])
def test_mamba_with_tp_and_fsdp_equals_single_device(rank_pools: RankPools, mesh: dict[str, int]) -> None:
    """hf-mamba on 4 ranks under cp=2 with tp=2 and with fsdp (two sequences) beside it, the greedy
    choice, float64: under cp+tp the forward convolutions split the sequence over both axes (the halo
    comes from the rank before in the group over cp and tp, whose ranks hold the pieces in order) and
    the scans split their steps over cp and their channels over tp; loss, every gradient and the
    parameters after AdamW steps equal single device."""
    results = _on_cp(rank_pools, "hf-mamba", 4, 64, "greedy", mesh)
    for r in results:
        assert [p for p, _ in r["recurrences"]] == ["fwd", "fwd", "bwd", "bwd"], r["recurrences"]
        assert all(on["cp"] == "S(1)" for _, on in r["recurrences"]), r["recurrences"]
        if "tp" in mesh:
            forward = [on for p, on in r["convolutions"] if p == "fwd"]
            assert forward == [{"cp": "S(2)", "tp": "S(2)"}] * 2, r["convolutions"]
