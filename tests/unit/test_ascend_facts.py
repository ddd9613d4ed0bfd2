"""The Ascend backend's fact table of torchair converters, the parser that builds it from torchair's
sources, and the refusal of an op no converter takes, before anything runs."""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx

from meshfold import ir
from meshfold.backends.ascend import converters, ge_module
from meshfold.backends.eager import OP_META
from meshfold.passes import PassError
from meshfold.tools.torchair_facts import converted, decomposed

SOURCE = '''
import torch

@register_fx_node_ge_converter(torch.ops.aten.silu.default)
def silu(self, meta_outputs=None):
    """NB: aten::silu(Tensor self) -> Tensor"""
    return ge.Swish(self)

@register_fx_node_ge_converter(torch.ops.aten.silu.out)
def silu_out(self, *, out=None, meta_outputs=None):
    """NB: aten::silu.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)"""
    raise NotImplementedError("torch.ops.aten.silu.out ge converter is not implemented!")

if torch.__version__ >= "2.3.1":
    @register_fx_node_ge_converter(torch.ops._c10d_functional.all_reduce.default)
    def all_reduce(self, reduce_type, group_name, *, out=None, meta_outputs=None):
        if reduce_type == "avg":
            raise NotImplementedError("avg")
        return ge.HcomAllReduce(self)
'''


def test_parser_keeps_converters_that_convert_and_leaves_stubs_out() -> None:
    assert sorted(converted(SOURCE)) == [
        ("_c10d_functional.all_reduce.default", True),
        ("aten.silu.default", True),
        ("aten.silu.out", False),
    ]
    decomp = (
        "def get_npu_default_decompositions():\n"
        "    d = {}\n"
        "    d.update({torch.ops.npu_define.allgather.default: f})\n"
        "    return d\n"
    )
    assert decomposed(decomp) == {"npu_define.allgather.default"}


def test_table_names_its_source_and_holds_the_collectives_graph_mode_converts() -> None:
    source, known = converters()
    assert re.search(r"Ascend/torchair [0-9a-f]{40} \(\d{4}-\d\d-\d\d\)", source), source
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "wait_tensor"):
        assert f"_c10d_functional.{op}.default" in known
    assert {"aten.mm.default", "aten.embedding_dense_backward.default"} <= known
    assert "aten.lgamma.default" not in known  # NOTE: torchair registers no converter that converts it


def test_an_op_without_a_converter_is_refused_naming_its_module_and_line() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.lgamma.default, (x,))
    x_value = ir.Value("x", ir.TensorType((4,), torch.float32))
    y_value = ir.Value("y", ir.TensorType((4,), torch.float32))
    node.meta[OP_META] = ir.Op(
        torch.ops.aten.lgamma.default, (x_value,), (), (y_value,), ir.Provenance("head.loss", "fwd", "model.py:12")
    )
    graph.output((node,))
    mode = FakeTensorMode()
    with mode:
        fake = torch.empty(4)
    with pytest.raises(PassError) as err:
        ge_module(fx.GraphModule(torch.nn.Module(), graph), [fake], mode, "the forward")
    message = str(err.value)
    assert message.startswith("backend='ascend' cannot lower aten.lgamma at head.loss (fwd, model.py:12)"), message
    assert "aten.lgamma.default" in message and "Ascend/torchair" in message
