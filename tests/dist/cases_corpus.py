"""Tasks on corpus entries beyond one cell (``meshfold.tools.corpus.cell``): what a training loop
does besides one backward per step."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from meshfold.api import parallelize
from meshfold.tools.corpus import catalog as registry
from meshfold.tools.corpus import entries as corpus_entries
from meshfold.tools.pool_worker import device_mesh


def accumulated_and_clipped(entry: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str) -> float:
    """Two backward calls before each step (gradient accumulation), then ``clip_grad_norm_``: every
    gradient equals the single-device model's, for two steps; returns the largest relative difference.
    Both act in place on ``.grad``, so two parameters sharing one gradient tensor would each change the
    other's (the output biases of a parallel-residual block get one sum)."""
    e, pm, ref, inputs = _compiled(entry, shape, names, plan)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pm, ref)]
    halves = [tuple(x[k::2] for x in inputs) for k in range(2)]
    worst = 0.0
    for _ in range(2):
        norms = []
        for model in (pm, ref):
            for half in halves:
                e.loss(model(*half)).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=0)
        want = dict(ref.named_parameters())
        for name, p in pm.named_parameters():
            got, exp = p.grad.full_tensor(), want[name].grad
            err = float((got - exp).abs().max()) / max(float(exp.abs().max()), 1e-12)
            assert err < 1e-4, f"grad {name} differs by {err:.2e} of its largest entry"
            worst = max(worst, err)
        for o in opts:
            o.step()
            o.zero_grad()
    return worst


def uneven_batches(
    entry: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str, batches: tuple[int, ...]
) -> list[str]:
    """Compiled for the entry's batch of 8, then trained on ``batches`` (a last batch of an epoch the
    data-parallel ranks do not divide among them): each step's loss and gradients equal the
    single-device model's, and the parameters after every AdamW step. Returns, per batch, the layout
    its program gave the first input."""
    e, pm, ref, inputs = _compiled(entry, shape, names, plan)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (pm, ref)]
    layouts = []
    for b in batches:
        part = tuple(x[:b] for x in inputs)
        losses = []
        for model, opt in zip((pm, ref), opts, strict=True):
            opt.zero_grad()
            loss = e.loss(model(*part))
            loss.backward()
            losses.append(float(loss))
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), f"batch {b}: loss {losses}"
        want = dict(ref.named_parameters())
        for name, p in pm.named_parameters():
            got, exp = p.grad.full_tensor(), want[name].grad
            err = float((got - exp).abs().max()) / max(float(exp.abs().max()), 1e-12)
            assert err < 1e-4, f"batch {b}: grad {name} differs by {err:.2e} of its largest entry"
        for opt in opts:
            opt.step()
        program = next(reversed(pm._mf_programs._held.values()))  # NOTE: the one this step ran
        layouts.append(str(next(i.value.layout for i in program.graph.inputs if i.kind == "input")))
    want = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.detach().full_tensor(), want[name].detach(), rtol=0, atol=5e-5)
    return layouts


def _compiled(
    entry: str, shape: tuple[int, ...], names: tuple[str, ...], plan: str
) -> tuple[registry.Entry, torch.nn.Module, torch.nn.Module, tuple[Any, ...]]:
    """The corpus entry compiled under ``plan`` on a mesh of ``shape``/``names``, and its single-device twin."""
    warnings.filterwarnings("ignore")
    e = corpus_entries.get(entry)
    net, inputs = e.build()
    ref, _ = e.build()
    return e, parallelize(net, device_mesh(shape, names), inputs, plan=plan), ref, inputs
