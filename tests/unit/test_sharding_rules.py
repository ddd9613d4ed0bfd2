"""Sharding rules checked by execution (ShardCombine): every strategy of every op in the zoo's joint
graphs, run on 2 and 4 simulated ranks from real values, combines back to the op's real result.

Also: the notation parser, ``einsum_strategies`` on known specs, that every captured op has a rule
of ours, and that the DTensor fallback adapter gives strategies that pass the same check.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
import torch

from meshfold import ir
from meshfold.backends.interpret import run_values
from meshfold.ir import Op, Partial, R, Shard, Value
from meshfold.passes.sharding.rules import RuleError, rule_coverage, rule_table, strategies_for
from meshfold.passes.sharding.rules.fallback import fallback_strategies
from meshfold.passes.sharding.rules.operands import view_dim_map
from meshfold.passes.sharding.rules.table import RuleTable
from meshfold.passes.sharding.strategy import Einsum, Strategy, einsum_strategies
from meshfold.tools.zoo import build
from meshfold.tracing.tracer import capture
from tests.sharding_sim import check_strategy, runnable

aten = torch.ops.aten
MODELS = ["mlp", "gpt2-tiny", "llama-tiny", "mixtral-tiny", "hf-llama"]
CASES = [pytest.param(n, marks=[pytest.mark.hf] if n.startswith("hf-") else [], id=n) for n in MODELS]
AXIS_SIZES = (2, 4)


@cache
def _table() -> RuleTable:
    return rule_table()


@cache
def _captured(name: str) -> ir.Graph:
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    model, inputs = build(name)
    return capture(model, inputs)


@cache
def _values(name: str) -> dict[Value, Any]:
    """The runtime value of every IR value of the model's joint graph (one interpreter run)."""
    g = _captured(name)
    model, inputs = build(name)
    feeds = {k: t.detach() for k, t in [*model.named_parameters(), *model.named_buffers()]}
    feeds |= {i.name: x for i, x in zip([i for i in g.inputs if i.kind == "input"], inputs, strict=True)}
    return run_values(g, feeds)


def _checkable(op: Op) -> bool:
    """Pure ops, plus attention kernels whose only impurity is dropout RNG and ``dropout_p == 0``."""
    if ir.is_pure(op.target):
        return True
    target = op.target
    if isinstance(target, ir.OpDef) or target._schema.is_mutable:
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    return (op.args[i] if i < len(op.args) else op.kwarg("dropout_p", 0.0)) == 0.0


def _signature(op: Op) -> tuple[object, ...]:
    """Ops equal up to value names get the same strategies; check one of each."""

    def sig(a: object) -> object:
        if isinstance(a, Value):
            return str(a.type)
        if isinstance(a, tuple):
            return tuple(sig(x) for x in a)
        return repr(a)

    return (op.target, sig(op.args), sig(op.kwargs), tuple(str(r.type) for r in op.results))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add start-up and contention cost (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _check_all(op: Op, env: dict[Value, Any], table: RuleTable, gen: torch.Generator) -> tuple[int, bool, list[str]]:
    """Check every strategy of ``op`` on every axis size that divides it: (runs, any sharded, failures)."""
    strategies, _ = strategies_for(op, table)
    ran, failures = 0, []
    for s in strategies:
        if s.exchange or s.passed or s.state:
            # NOTE: the op communicates itself under this one (the MoE all-to-all, ring attention, a running sum or
            # flip along a split dim): checked on ranks (tests/dist/test_moe_dispatch.py, test_context_parallel.py)
            continue
        for n in AXIS_SIZES:
            if not runnable(op, s, n):
                continue
            try:
                check_strategy(op, s, env, n, gen)
                ran += 1
            except Exception as e:
                failures.append(f"{op.describe()} {s} on {n} ranks: {str(e).splitlines()[0]}")
    sharded = any(p != R for s in strategies for p in (*s.inputs, *s.outputs))
    return ran, sharded, failures


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", CASES)
def test_every_strategy_combines_to_the_global_result(name: str) -> None:
    g, env, table = _captured(name), _values(name), _table()
    gen = torch.Generator().manual_seed(0)
    seen: set[tuple[object, ...]] = set()
    ran, sharded, failures = 0, 0, []
    for op in g.ops:
        key = _signature(op)
        if not _checkable(op) or key in seen:
            continue
        seen.add(key)
        n_ran, any_sharded, bad = _check_all(op, env, table, gen)
        ran, sharded, failures = ran + n_ran, sharded + any_sharded, failures + bad
    assert not failures, f"{len(failures)} strategies do not combine:\n" + "\n".join(failures[:40])
    assert ran > 2 * len(seen), f"only {ran} strategy runs for {len(seen)} distinct ops"
    assert sharded > 0.8 * len(seen), f"only {sharded} of {len(seen)} distinct ops have a non-Replicate strategy"


@pytest.mark.parametrize("name", CASES)
def test_every_captured_op_has_a_rule_of_ours(name: str) -> None:
    g, table = _captured(name), _table()
    elsewhere = sorted({f"{op.name} ({src})" for op in g.ops if (src := strategies_for(op, table)[1]) != "rule"})
    if elsewhere:
        print(f"{name}: ops without a rule of ours: {', '.join(elsewhere)}")
    assert not elsewhere, f"{name}: ops without a rule of ours: {elsewhere}"


def test_notation_parser() -> None:
    e = Einsum.parse("m k, k n -> m n")
    assert e.operands == (("m", "k"), ("k", "n")) and e.results == (("m", "n"),)
    e = Einsum.parse("b _ h1, h1 -> b _")
    assert e.operands == (("b", "_", "h1"), ("h1",)) and e.results == (("b", "_"),)
    assert Einsum.parse("k, k -> ").results == ((),), "an empty right side is one 0-d result"
    assert Einsum.parse(" -> a b").operands == ()
    with pytest.raises(ValueError, match="needs '->'"):
        Einsum.parse("m k, k n")


def test_einsum_strategies_mm_bmm_and_sum() -> None:
    mm = einsum_strategies("m k, k n -> m n")
    assert mm == [
        Strategy((R, R), (R,)),
        Strategy((Shard(0), R), (Shard(0),)),
        Strategy((Shard(1), Shard(0)), (Partial("sum"),)),
        Strategy((R, Shard(1)), (Shard(1),)),
    ]
    bmm = einsum_strategies("b m k, b k n -> b m n", linear=(0,))
    assert Strategy((Shard(0), Shard(0)), (Shard(0),)) in bmm
    assert Strategy((Shard(2), Shard(1)), (Partial("sum"),)) in bmm
    assert Strategy((Partial("avg"), R), (Partial("avg"),)) in bmm
    assert Strategy((R, Partial("sum")), (Partial("sum"),)) not in bmm
    mean = einsum_strategies("a b -> a _", reduce="avg")
    assert mean == [
        Strategy((R,), (R,)),
        Strategy((Shard(0),), (Shard(0),)),
        Strategy((Shard(1),), (Partial("avg"),)),
    ]
    whole = einsum_strategies("a _ -> a")
    assert Strategy((Shard(1),), (Partial("sum"),)) not in whole


def test_view_dim_map_groups() -> None:
    assert view_dim_map((6, 4), (24,)) == {0: 0}
    assert view_dim_map((2, 3, 4), (6, 4)) == {0: 0, 2: 1}
    assert view_dim_map((6, 4), (2, 3, 4)) == {0: 0, 1: 2}
    assert view_dim_map((2, 1, 16), (2, 16)) == {0: 0, 2: 1}
    assert view_dim_map((4, 6), (6, 4)) == {0: 0}
    assert view_dim_map((4, 6), (3, 8)) == {0: 0}
    assert view_dim_map((2, 6), (3, 4)) == {0: 0}
    assert view_dim_map((2, 16, 4, 16), (2, 16, 64)) == {0: 0, 1: 1, 2: 2}


def _single_op(target: Any, *args: Any, **kwargs: Any) -> tuple[Op, dict[Value, Any]]:
    """A one-op IR fragment ``target(*args, **kwargs)`` (tensors anywhere in the arguments become
    values) and the real value of every value in it."""
    env: dict[Value, Any] = {}

    def lift(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            v = Value(f"x{len(env)}", ir.tensor_type(a))
            env[v] = a
            return v
        if isinstance(a, (list, tuple)):
            return tuple(lift(x) for x in a)
        return a

    ir_args = tuple(lift(a) for a in args)
    ir_kwargs = tuple((k, lift(v)) for k, v in kwargs.items())
    out = target(*args, **kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    results = tuple(
        Value(f"r{i}", ir.tensor_type(t) if isinstance(t, torch.Tensor) else ir.ScalarType("none"))
        for i, t in enumerate(outs)
    )
    env.update(zip(results, outs, strict=True))
    return Op(target, ir_args, ir_kwargs, results), env


def _x(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _idx(high: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(high, shape, generator=torch.Generator().manual_seed(seed))


# NOTE: ops DTensor knows and we deliberately have no rule for (the adapter's test cases).
FALLBACK_CASES: dict[str, Any] = {
    "atan2": lambda: _single_op(aten.atan2.default, _x(4, 8), _x(4, 8, seed=1)),
    "hypot-broadcast": lambda: _single_op(aten.hypot.default, _x(4, 8), _x(8, seed=1)),
    "cumprod": lambda: _single_op(aten.cumprod.default, _x(4, 8), 1),
    "logcumsumexp": lambda: _single_op(aten.logcumsumexp.default, _x(4, 8), 1),
    "vector-norm": lambda: _single_op(aten.linalg_vector_norm.default, _x(4, 8), 2, [1]),
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", sorted(FALLBACK_CASES))
def test_dtensor_fallback_strategies_combine(case: str) -> None:
    op, env = FALLBACK_CASES[case]()
    table = _table()
    assert table.get(op.target) is None, f"{op.name} has a rule of ours; pick another op for this test"
    strategies, source = strategies_for(op, table)
    assert source == "dtensor", source
    assert strategies[0] == Strategy(tuple(R for _ in op.operands), tuple(R for _ in op.results))
    assert any(isinstance(p, Shard) for s in strategies for p in s.inputs), [str(s) for s in strategies]
    ran, _, failures = _check_all(op, env, table, torch.Generator().manual_seed(2))
    assert not failures, "\n".join(failures)
    assert ran >= 2


def test_fallback_is_sensible_for_known_shapes() -> None:
    op, _ = _single_op(aten.cumprod.default, _x(4, 8), 1)
    got = fallback_strategies(op)
    assert got is not None and Strategy((Shard(0),), (Shard(0),)) in got
    assert not any(s.inputs == (Shard(1),) for s in got), "cumprod must not shard its scanned dim"
    op, _ = _single_op(aten.hypot.default, _x(4, 8), _x(8))
    got = fallback_strategies(op)
    assert got is not None
    assert Strategy((Shard(1), Shard(0)), (Shard(1),)) in got
    assert Strategy((Shard(0), R), (Shard(0),)) in got
    op, _ = _single_op(aten.linalg_vector_norm.default, _x(4, 8), 2, [1])
    got = fallback_strategies(op)
    # NOTE: DTensor shards the reduced dim into a _NormPartial, which we cannot express: dropped.
    assert got is not None and not any(isinstance(p, Partial) for s in got for p in s.outputs)


def _layer_norm_backward() -> tuple[Op, dict[Value, Any]]:
    x, w = _x(2, 4, 8), _x(8, seed=1)
    _, mean, rstd = aten.native_layer_norm.default(x, [8], w, None, 1e-5)
    return _single_op(
        aten.native_layer_norm_backward.default, _x(2, 4, 8, seed=2), x, [8], mean, rstd, w, None, [True, True, False]
    )


def _mask(*shape: int) -> torch.Tensor:
    return _x(*shape, seed=7) > 0


# NOTE: rules the zoo's graphs do not exercise (or not in these forms), checked the same way.
RULE_CASES: dict[str, Any] = {
    "amax-keepdim": lambda: _single_op(aten.amax.default, _x(4, 8), [1], True),
    "max-dim": lambda: _single_op(aten.max.dim, _x(4, 8), 1),
    "max-all": lambda: _single_op(aten.max.default, _x(4, 8)),
    "argmax": lambda: _single_op(aten.argmax.default, _x(4, 8), 1),
    "var": lambda: _single_op(aten.var.correction, _x(4, 8), [0], correction=1),
    "sum-empty-dims": lambda: _single_op(aten.sum.dim_IntList, _x(4, 8), []),
    "mean-all": lambda: _single_op(aten.mean.default, _x(4, 8)),
    "logsumexp": lambda: _single_op(aten.logsumexp.default, _x(4, 8), [1]),
    "cumsum": lambda: _single_op(aten.cumsum.default, _x(4, 8), 1),
    "sort": lambda: _single_op(aten.sort.default, _x(4, 8), 1),
    "topk-dim0": lambda: _single_op(aten.topk.default, _x(8, 4), 2, 0),
    "index-select": lambda: _single_op(aten.index_select.default, _x(8, 4), 0, _idx(8, 4)),
    "gather-along-dim": lambda: _single_op(aten.gather.default, _x(4, 8), 1, _idx(8, 4, 6)),
    "scatter-add": lambda: _single_op(aten.scatter_add.default, _x(4, 8), 1, _idx(8, 4, 8), _x(4, 8, seed=1)),
    "scatter-value-zero": lambda: _single_op(aten.scatter.value, _x(4, 8), 1, _idx(8, 4, 2), 0.0),
    "index-put-acc": lambda: _single_op(aten.index_put.default, _x(8, 4), [_idx(8, 4)], _x(4, 4, seed=1), True),
    "index-put-inner": lambda: _single_op(aten.index_put.default, _x(4, 8), [None, _idx(8, 4)], _x(4, 4, seed=1)),
    "index-non-adjacent": lambda: _single_op(aten.index.Tensor, _x(4, 6, 8), [_idx(4, 4), None, _idx(8, 4, seed=1)]),
    "index-middle": lambda: _single_op(aten.index.Tensor, _x(4, 6, 8), [None, _idx(6, 2, 4)]),
    "histc": lambda: _single_op(aten.histc.default, _x(4, 8), 10, -3.0, 3.0),
    "repeat": lambda: _single_op(aten.repeat.default, _x(4, 8), [2, 1, 1]),
    "flip": lambda: _single_op(aten.flip.default, _x(4, 8), [1]),
    "pad-zero": lambda: _single_op(aten.constant_pad_nd.default, _x(4, 8), [1, 2], 0.0),
    "pad-value": lambda: _single_op(aten.constant_pad_nd.default, _x(4, 8), [0, 0, 1, 1], 2.0),
    "squeeze-all": lambda: _single_op(aten.squeeze.default, _x(4, 1, 8)),
    "squeeze-noop": lambda: _single_op(aten.squeeze.dim, _x(4, 8), 0),
    "permute": lambda: _single_op(aten.permute.default, _x(2, 4, 8), [2, 0, 1]),
    "expand": lambda: _single_op(aten.expand.default, _x(4, 1), [2, 4, 8]),
    "view-split": lambda: _single_op(aten.view.default, _x(8, 6), [2, 4, 6]),
    "view-merge": lambda: _single_op(aten.view.default, _x(2, 4, 6), [8, 6]),
    "view-reorder": lambda: _single_op(aten._unsafe_view.default, _x(4, 6), [6, 4]),
    "stack": lambda: _single_op(aten.stack.default, [_x(4, 8), _x(4, 8, seed=1)], 1),
    "unbind": lambda: _single_op(aten.unbind.int, _x(4, 3, 8), 1),
    "split-sizes": lambda: _single_op(aten.split_with_sizes.default, _x(4, 8), [3, 5], 1),
    "select-backward": lambda: _single_op(aten.select_backward.default, _x(4, 8), [4, 3, 8], 1, 2),
    "slice-whole": lambda: _single_op(aten.slice.Tensor, _x(4, 8), 1, 0, 8),
    "sdpa-gqa": lambda: _single_op(
        aten.scaled_dot_product_attention.default,
        _x(2, 4, 8, 4),
        _x(2, 2, 8, 4, seed=1),
        _x(2, 2, 8, 4),
        enable_gqa=True,
    ),
    "sdpa-math-mask": lambda: _single_op(
        aten._scaled_dot_product_attention_math.default, _x(2, 4, 8, 4), _x(2, 4, 8, 4), _x(2, 4, 8, 4), _x(2, 1, 8, 8)
    ),
    "flash-cpu-mask": lambda: _single_op(
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        *(_x(2, 4, 8, 4, seed=i) for i in range(3)),
        0.0,
        False,
        attn_mask=_x(1, 4, 8, 8),
    ),
    "layer-norm-plain": lambda: _single_op(aten.native_layer_norm.default, _x(2, 4, 8), [8], None, None, 1e-5),
    "layer-norm-2d": lambda: _single_op(aten.native_layer_norm.default, _x(2, 4, 8), [4, 8], _x(4, 8), _x(4, 8), 1e-5),
    "layer-norm-backward-masked": _layer_norm_backward,
    "rms-norm": lambda: _single_op(aten._fused_rms_norm.default, _x(2, 4, 8), [8], _x(8), 1e-6),
    "masked-fill-zero": lambda: _single_op(aten.masked_fill.Scalar, _x(4, 8), _mask(4, 8), 0.0),
    "masked-fill-inf": lambda: _single_op(aten.masked_fill.Scalar, _x(4, 8), _mask(8), float("-inf")),
    "where-scalar": lambda: _single_op(aten.where.ScalarOther, _mask(4, 8), _x(4, 8), 0.5),
    "maximum": lambda: _single_op(aten.maximum.default, _x(4, 8), _x(8, seed=1)),
    "clamp": lambda: _single_op(aten.clamp.default, _x(4, 8), -0.5, 0.5),
    "exp": lambda: _single_op(aten.exp.default, _x(4, 8)),
    "add-scalar": lambda: _single_op(aten.add.Scalar, _x(4, 8), 2.0),
    "add-alpha": lambda: _single_op(aten.add.Tensor, _x(4, 8), _x(8, seed=1), alpha=-2),
    "sub": lambda: _single_op(aten.sub.Tensor, _x(4, 8), _x(4, 8, seed=1)),
    "sigmoid-backward": lambda: _single_op(aten.sigmoid_backward.default, _x(4, 8), _x(4, 8, seed=1).sigmoid()),
    "baddbmm": lambda: _single_op(aten.baddbmm.default, _x(8), _x(2, 4, 6), _x(2, 6, 8), beta=0.5, alpha=2.0),
    "addmm-2d-bias": lambda: _single_op(aten.addmm.default, _x(4, 8), _x(4, 6), _x(6, 8)),
    "mv": lambda: _single_op(aten.mv.default, _x(4, 8), _x(8)),
    "dot": lambda: _single_op(aten.dot.default, _x(8), _x(8, seed=1)),
    "new-full": lambda: _single_op(aten.new_full.default, _x(2, 3), [4, 8], 1.5),
    "full-like": lambda: _single_op(aten.full_like.default, _x(4, 8), 2.0),
    "safe-softmax": lambda: _single_op(aten._safe_softmax.default, _x(4, 8), 1),
    "embedding-backward-freq": lambda: _single_op(
        aten.embedding_dense_backward.default, _x(2, 4, 8), _idx(10, 2, 4), 10, -1, True
    ),
    "arange": lambda: _single_op(aten.arange.start_step, 0, 8, 2),
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_rule_cases_combine(case: str) -> None:
    op, env = RULE_CASES[case]()
    table = _table()
    _, source = strategies_for(op, table)
    assert source == "rule", f"{op.name} is served by {source}"
    ran, _, failures = _check_all(op, env, table, torch.Generator().manual_seed(3))
    assert not failures, "\n".join(failures)
    assert ran >= 1


@pytest.mark.usefixtures("one_thread")
def test_symbolic_scalar_operands_stay_replicate() -> None:
    x = _x(8, 6)
    size = Value("s", ir.ScalarType("int"))
    xv, out = Value("x", ir.tensor_type(x)), Value("r", ir.tensor_type(x.view(2, 4, 6)))
    op = Op(aten.view.default, (xv, (2, size, 6)), (), (out,))
    strategies, source = strategies_for(op, _table())
    assert source == "rule" and all(s.inputs[1] == R for s in strategies)
    assert Strategy((Shard(0), R), (Shard(0),)) in strategies
    env: dict[Value, Any] = {xv: x, size: 4, out: x.view(2, 4, 6)}
    ran, _, failures = _check_all(op, env, _table(), torch.Generator().manual_seed(4))
    assert not failures and ran >= 2, failures


def test_malformed_rule_is_an_error_naming_the_op() -> None:
    op, _ = _single_op(aten.mm.default, _x(4, 8), _x(8, 2))
    table = _table()
    bad = RuleTable({**table.rules, op.target: lambda o: [Strategy((Shard(2), R), (R,))]}, table.family)
    with pytest.raises(RuleError, match=r"aten\.mm .*S\(2\)"):
        strategies_for(op, bad)


def test_op_unknown_everywhere_is_replicated() -> None:
    op, _ = _single_op(aten.polar.default, torch.rand(4), torch.rand(4))
    if fallback_strategies(op) is not None:
        pytest.skip("DTensor learned aten.polar; pick another unknown op")
    got, source = strategies_for(op, _table())
    assert source == "replicate" and got == [Strategy((R, R), (R,))]


def test_rule_coverage_counts() -> None:
    ours, dtensor = rule_coverage()
    print(f"sharding rules: {ours} ops with ours, {dtensor} more on the DTensor fallback")
    assert ours == len(_table().rules) and ours > 150
    assert dtensor > 0
