"""Capture of the zoo and HF models: names, provenance, round trip, determinism, and numerics —
the captured joint graph, run op by op, gives the eager model's loss and every gradient."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from meshfold import CaptureError, capture, ir
from meshfold.backends.interpret import interpret
from meshfold.rewrites.moe_lists import as_unstacked, stack_tensors
from meshfold.tools.zoo import build, zoo_names

HF = {name for name in zoo_names() if name.startswith("hf-")}
NAMES = zoo_names()


@cache
def _captured(name: str) -> tuple[ir.Graph, str]:
    model, inputs = build(name)
    g = capture(model, inputs)
    return g, str(g)


def _marks(name: str) -> list[pytest.MarkDecorator]:
    return [pytest.mark.hf] if name in HF else []


CASES = [pytest.param(n, marks=_marks(n), id=n) for n in NAMES]


def test_zoo_has_the_four_builtins_and_two_hf_models() -> None:
    assert {"mlp", "gpt2-tiny", "llama-tiny", "mixtral-tiny", "hf-llama", "hf-mixtral"} <= set(NAMES)


@pytest.mark.parametrize("name", CASES)
def test_round_trip_and_verify(name: str) -> None:
    g, text = _captured(name)
    ir.verify(g)
    assert str(ir.parse(text)) == text


@pytest.mark.parametrize("name", CASES)
def test_two_captures_print_identical_text(name: str) -> None:
    _, text = _captured(name)
    model, inputs = build(name)
    assert str(capture(model, inputs)) == text


@pytest.mark.parametrize("name", CASES)
def test_inputs_and_grads_use_the_models_names(name: str) -> None:
    g, _ = _captured(name)
    model, _inputs = build(name)
    # NOTE: experts folded from an nn.ModuleList are one stacked parameter each, where the first member was.
    first = {s.members[0][0]: s.name for s in g.stacks}
    members = {m for s in g.stacks for row in s.members for m in row}
    params = [first.get(n, n) for n, _ in model.named_parameters() if n in first or n not in members]
    assert [i.name for i in g.inputs if i.kind == "param"] == params
    assert {o.name for o in g.outputs if o.kind == "grad"} == set(params)
    # NOTE: a buffer the forward never reads (HF's rotary `original_inv_freq`) is not an input.
    assert {i.name for i in g.inputs if i.kind == "buffer"} <= {n for n, _ in model.named_buffers()}
    assert [o.name for o in g.outputs if o.kind == "out"] == ["0"]
    assert [i.kind for i in g.inputs].count("tangent") == 1


@pytest.mark.parametrize("name", CASES)
def test_every_op_carries_phase_module_and_source(name: str) -> None:
    g, _ = _captured(name)
    phases = [op.prov.phase for op in g.ops]
    assert "fwd" in phases and "bwd" in phases
    # NOTE: the joint graph is forward then backward; once backward starts, no forward op follows
    # (AOT may keep a few shape-only forward ops, so check the bulk rather than every op).
    assert phases.index("bwd") > len(phases) // 4
    model, _ = build(name)
    modules = dict(model.named_modules())
    matmuls = [op for op in g.ops if op.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    linear_ops = [op for op in matmuls if isinstance(modules.get(op.prov.module), torch.nn.Linear)]
    assert len(linear_ops) >= len(matmuls) // 2, sorted({op.prov.module for op in matmuls})
    with_source = [op for op in g.ops if op.prov.source]
    assert len(with_source) >= 0.9 * len(g.ops)
    if name not in HF:
        ours = ("models.py:", "moe_zoo.py:", "shared.py:", "hybrid.py:")
        assert all(op.prov.source.startswith(ours) for op in with_source if op.prov.phase == "fwd")


@pytest.mark.parametrize("name", CASES)
def test_captured_graph_computes_the_models_loss_and_gradients(name: str) -> None:
    g, _ = _captured(name)
    assert_graph_matches_eager(g, *build(name))


def assert_graph_matches_eager(g: ir.Graph, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """``g``, interpreted, gives ``model``'s eager loss and every parameter's gradient (experts folded
    from an nn.ModuleList run on stacks of the model's weights; their gradients are cut back out)."""
    loss = model(*inputs)
    loss.backward()
    feeds = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    feeds |= stack_tensors(g.stacks, feeds)
    feeds |= {i.name: x for i, x in zip((i for i in g.inputs if i.kind == "input"), inputs, strict=True)}
    got = interpret(g, feeds)
    torch.testing.assert_close(got[("out", "0")], loss.detach(), rtol=1e-5, atol=1e-6)
    grads = as_unstacked(g.stacks, {name: t for (kind, name), t in got.items() if kind == "grad"})
    for pname, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[pname], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=pname: f"{n}: {m}")


def test_llama_tiny_module_paths_are_fqns() -> None:
    g, _ = _captured("llama-tiny")
    paths = {op.prov.module for op in g.ops}
    for expected in ("layers.0.self_attn.q_proj", "layers.1.mlp.down_proj", "lm_head", "embed_tokens"):
        assert expected in paths, sorted(paths)[:20]
    bwd_paths = {op.prov.module for op in g.ops if op.prov.phase == "bwd"}
    assert "layers.0.self_attn.q_proj" in bwd_paths


@pytest.mark.hf
def test_hf_llama_module_paths_are_fqns() -> None:
    g, _ = _captured("hf-llama")
    paths = {op.prov.module for op in g.ops}
    assert "model.layers.0.self_attn.q_proj" in paths and "lm_head" in paths


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # the construct the error must name
            h = h * 2
        return h.sum()


class _MutatesParam(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin.weight.add_(1.0)  # the construct the error must name
        return self.lin(x).sum()


class _CountsCalls(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.lin(x).sum()


def _line_of(cls: type, marker: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(cls)
    return start + next(i for i, ln in enumerate(lines) if marker in ln)


def test_data_dependent_control_flow_names_construct_and_line() -> None:
    with pytest.raises(CaptureError) as info:
        capture(_Branchy(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "data-dependent Python control flow" in msg
    assert f"test_capture.py:{_line_of(_Branchy, 'if h.sum()')}" in msg
    assert "torch.where" in msg


def test_parameter_mutation_names_construct_and_line() -> None:
    with pytest.raises(CaptureError) as info:
        capture(_MutatesParam(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "in-place mutation of parameter `lin.weight`" in msg
    assert f"test_capture.py:{_line_of(_MutatesParam, 'weight.add_')}" in msg


def test_buffer_updates_become_update_outputs() -> None:
    model = _CountsCalls()
    g = capture(model, (torch.randn(2, 4),))
    (upd,) = [o for o in g.outputs if o.kind == "update"]
    assert upd.name == "calls"
    got = interpret(
        g,
        {
            "lin.weight": model.lin.weight.detach(),
            "lin.bias": model.lin.bias.detach(),
            "calls": torch.tensor(3.0),
            "x": torch.randn(2, 4),
        },
    )
    assert got[("update", "calls")].item() == 4.0


def test_capture_leaves_the_model_untouched() -> None:
    model, inputs = build("mlp")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    capture(model, inputs)
    for n, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and torch.equal(p.detach(), before[n])


def test_meta_device_model_captures_without_allocating() -> None:
    from meshfold.tools.zoo.models import LlamaTiny

    with torch.device("meta"):
        model = LlamaTiny()
    ids = torch.zeros(2, 16, dtype=torch.long)
    g = capture(model, (ids, ids))
    assert any(o.kind == "grad" for o in g.outputs)
    assert all(p.is_meta for p in model.parameters())
