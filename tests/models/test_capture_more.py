"""Capture beyond the zoo: buffers updated in place, recurrent layers, nn.Transformer, bf16 and
several outputs — round trip, verify, cleanup, and numerics against eager where deterministic."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from meshfold import capture, compile_model, ir
from meshfold.backends.interpret import interpret
from tests.models import extra

FACTORIES: dict[str, Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]] = {
    "cnn": extra.cnn,
    "rnn": extra.rnn,
    "tx": extra.tx,
    "tuple-out": extra.tup,
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_capture_round_trip_verify_cleanup(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = FACTORIES[name]()
    g = capture(model, inputs)
    text = str(g)
    assert str(ir.parse(text)) == text
    ir.verify(g)
    cleaned = compile_model(g, None, "cleanup,verify").graph
    assert len(cleaned.ops) <= len(g.ops)


def test_batchnorm_running_stats_are_update_outputs() -> None:
    model, inputs = extra.cnn()
    g = capture(model, inputs)
    updates = {o.name for o in g.outputs if o.kind == "update"}
    assert updates == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}


@pytest.mark.parametrize("name", ["rnn", "tx", "tuple-out"])
def test_numerics_match_eager(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = FACTORIES[name]()
    g = compile_model(model, inputs, "cleanup").graph
    outs = model(*inputs)
    first = outs[0] if isinstance(outs, tuple) else outs
    first.float().backward()
    feeds = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    feeds |= {i.name: x for i, x in zip([i for i in g.inputs if i.kind == "input"], inputs, strict=True)}
    for i in g.inputs:
        if i.kind == "tangent" and i.name != "tangent.0":
            # NOTE: eager backward seeds only the loss; the other outputs get zero cotangents.
            t = i.value.type
            assert isinstance(t, ir.TensorType)
            feeds[i.name] = torch.zeros(tuple(int(d) for d in t.shape), dtype=t.dtype)
    got = interpret(g, feeds)
    torch.testing.assert_close(got[("out", "0")], first.detach())
    for pname, p in model.named_parameters():
        torch.testing.assert_close(got[("grad", pname)], p.grad, rtol=1e-4, atol=1e-5)


def test_python_scalar_arguments_are_constants_and_dict_outputs_flatten() -> None:
    model, inputs = extra.scalar_arg()
    g = capture(model, inputs)
    assert [i.name for i in g.inputs if i.kind == "input"] == ["x"]
    assert [o.name for o in g.outputs if o.kind == "out"] == ["0", "1"]
    x = inputs[0]
    assert isinstance(x, torch.Tensor)
    feeds = {k: v.detach() for k, v in model.named_parameters()} | {"x": x, "tangent.1": torch.zeros(2, 4)}
    got = interpret(g, feeds)
    expected = model(*inputs)
    torch.testing.assert_close(got[("out", "0")], expected["loss"].detach())
    torch.testing.assert_close(got[("out", "1")], expected["h"].detach())
