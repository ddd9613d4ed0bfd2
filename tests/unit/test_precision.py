"""The precision policy (``passes/precision.py``): how it is spelled, and where the ``precision`` pass
puts its casts (numerics on ranks: tests/dist/test_precision.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from meshfold.ir import TensorType
from meshfold.ir.ops import ALL_GATHER_BUCKET, ALL_REDUCE, REDUCE_SCATTER, REDUCE_SCATTER_BUCKET
from meshfold.passes import PassError
from meshfold.passes.options import DEFAULT_PIPELINE, Options
from meshfold.passes.precision import CAST, Precision
from meshfold.session import compile_model
from meshfold.tools.zoo import build

BF16, F32 = torch.bfloat16, torch.float32


def test_the_shorthands_and_fsdp2s_policy_spell_the_same_policy() -> None:
    assert Precision.of("bf16") == Precision(BF16, F32)
    assert Precision.of("bf16-reduce") == Precision(BF16, BF16)
    assert Precision.of("param=bf16,reduce=fp32,output=fp32") == Precision(BF16, F32, F32)
    assert Precision.of({"param": "bfloat16", "cast_inputs": False}) == Precision(BF16, None, None, False)
    assert Precision.of(MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=F32)) == Precision(BF16, F32)
    assert Precision.of("fp32") is None and Precision.of(MixedPrecisionPolicy()) is None
    assert Precision(BF16).reduce_dtype == BF16  # NOTE: FSDP2's rule: no reduce dtype, the param one


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("bf8", "unknown; use bf16"),
        ("param=int8", "not a floating dtype"),
        ({"reduce": "fp32"}, "needs a param dtype"),
        ({"param": "bf16", "master": "fp32"}, "unknown: master"),
    ],
)
def test_a_bad_policy_is_refused_naming_what_to_write(spec: object, said: str) -> None:
    with pytest.raises(PassError, match=said):
        Options.of(precision=spec)


def test_a_pipeline_without_the_precision_pass_is_refused() -> None:
    pipeline = DEFAULT_PIPELINE.replace("precision,", "")
    with pytest.raises(PassError, match="needs the precision pass"):
        Options.of(mesh="dp=2", precision="bf16", pipeline=pipeline)


def _compiled(precision: str, mesh: str = "dp=2", plan: str = "fsdp", model: str = "mlp") -> object:
    net, inputs = build(model)
    if model == "mlp":  # NOTE: a batch worth splitting (at 8 rows the solve splits the weights' inner dim)
        inputs = (torch.randn(256, 32), torch.randn(256, 16))
    return compile_model(net, inputs, Options.of(mesh=mesh, plan=plan, precision=precision)).graph


@pytest.mark.parametrize("precision", ["bf16", "bf16-reduce"])
def test_fsdp_gathers_bf16_shards_and_reduces_gradients_in_the_reduce_dtype(precision: str) -> None:
    graph = _compiled(precision)
    reduce = Precision.of(precision).reduce_dtype
    producers = graph.producers()
    params = {i.value for i in graph.inputs if i.kind == "param"}
    assert {i.value.type.dtype for i in graph.inputs if i.kind == "param"} == {F32}  # NOTE: master weights
    gathers = [op for op in graph.ops if op.target == ALL_GATHER_BUCKET]
    assert gathers
    for op in gathers:  # NOTE: each operand is a parameter's stored shard cast to bf16: half the bytes
        for x in op.operands:
            cast = producers[x]
            assert cast.target == CAST and x.type.dtype == BF16 and cast.operands[0] in params
            assert x.layout == cast.operands[0].layout
    scatters = [op for op in graph.ops if op.target in (REDUCE_SCATTER, REDUCE_SCATTER_BUCKET)]
    assert scatters and all(x.type.dtype == reduce for op in scatters for x in op.operands)
    grads = [o.value for o in graph.outputs if o.kind == "grad"]
    assert grads and all(isinstance(v.type, TensorType) and v.type.dtype == F32 for v in grads)


def test_tensor_parallel_partial_sums_travel_in_bf16() -> None:
    graph = _compiled("bf16", mesh="dp=2,tp=2", plan="fsdp+tp", model="llama-tiny")
    tp_sums = [op for op in graph.ops if op.target == ALL_REDUCE and op.kwarg("axis") == "tp"]
    assert tp_sums and all(op.operands[0].type.dtype == BF16 for op in tp_sums)


def test_without_a_policy_the_pass_leaves_the_graph_as_it_is() -> None:
    net, inputs = build("mlp")
    opts = Options.of(mesh="dp=2", plan="fsdp")
    with_pass = compile_model(net, inputs, opts).graph
    without = compile_model(
        net, inputs, Options.of(mesh="dp=2", plan="fsdp", pipeline=opts.pipeline.replace("precision,", ""))
    ).graph
    assert str(with_pass) == str(without)


def test_the_solve_prices_gradients_in_the_reduce_dtype() -> None:
    def dp_objective(precision: str) -> float:
        net, inputs = build("llama-tiny")
        opts = Options.of(mesh="dp=2,tp=2", plan="fsdp+tp", precision=precision)
        stats = compile_model(net, inputs, opts).stats["sharding.solve"]
        return next(s.objective for s in stats if s.axis == "dp")

    # NOTE: the same layouts; fp32 gradients put twice the bytes on dp's reduce-scatters
    assert dp_objective("bf16") > dp_objective("bf16-reduce")
