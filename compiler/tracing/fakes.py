"""Fake copies of a model's tensors and its inputs, for capture: nothing is allocated.

Real and meta parameters are swapped for fake ones for the duration of a capture and restored
afterwards (a model with 70B parameters on ``meta`` is never materialized); inputs become fake
tensors in the same fake mode, with the dims asked for symbolic (``capture(..., dynamic=)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import sympy
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext


def guards_of(mode: FakeTensorMode) -> list[sympy.Basic]:
    """The conditions the capture assumed of its symbolic sizes (each symbol's range, then every
    guard), in the symbols the graph keeps (a size found equal to another is written as that one)."""
    env = mode.shape_env
    assert env is not None
    found: list[sympy.Basic] = []
    for sym, vr in env.var_to_range.items():
        if vr.lower.is_finite:
            found.append(sympy.Ge(sym, vr.lower))
        if vr.upper.is_finite:
            found.append(sympy.Le(sym, vr.upper))
    found.extend(g.expr for g in env.guards)
    out: list[sympy.Basic] = []
    for g in found:
        kept = g.xreplace(env.replacements)
        if kept is not sympy.true and kept not in out:
            out.append(kept)
    return out


@contextlib.contextmanager
def fake_copies(
    model: nn.Module,
    inputs: Sequence[Any],
    dynamic: Sequence[tuple[int, int]] = (),
    param_dtype: torch.dtype | None = None,
) -> Iterator[tuple[FakeTensorMode, list[Any]]]:
    """Fake versions of ``inputs`` in the fake mode the model's tensors already live in (or a new one).
    ``param_dtype``: floating parameters are faked in it (a mixed-precision policy's compute dtype).

    NOTE: real and meta parameters are swapped for fake ones for the duration of the capture and
    restored afterwards, so a model with 70B parameters on ``meta`` is never materialized.
    """
    mode = _existing_fake_mode(model, inputs) or FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    # NOTE: meta tensors become fake tensors on the inputs' device, so a model built on ``meta``
    # runs beside real inputs; nothing is allocated either way.
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor) and not x.is_meta), torch.device("cpu"))
    swapped: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
    # NOTE: one fake per real tensor, so tied weights (GPT-2's lm_head/wte) stay one parameter.
    fakes: dict[int, torch.Tensor] = {}
    try:
        for mod in model.modules(remove_duplicate=False):
            for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
                for key, t in list(store.items()):
                    if t is None or isinstance(t, FakeTensor):
                        continue
                    if id(t) not in fakes:
                        fake = _fake_of(mode, t, device)
                        if is_param and param_dtype is not None and fake.is_floating_point():
                            with mode:
                                fake = fake.to(param_dtype)
                        fakes[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                    store[key] = fakes[id(t)]
                    swapped.append((mod, key, is_param, t))
        fake_inputs = [
            x
            if isinstance(x, FakeTensor) or not isinstance(x, torch.Tensor)
            else _fake_input(mode, x, [d for i, d in dynamic if i == k])
            for k, x in enumerate(inputs)
        ]
        yield mode, fake_inputs
    finally:
        for mod, key, is_param, t in reversed(swapped):
            (mod._parameters if is_param else mod._buffers)[key] = t  # type: ignore[assignment]


def _fake_input(mode: FakeTensorMode, x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """A fake copy of input ``x``, its ``dims`` symbolic (dynamo keeps them so: ``mark_dynamic``)."""
    if not dims:
        return mode.from_tensor(x, static_shapes=True)
    sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(x.dim())]
    fake = mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))
    for d in dims:
        torch._dynamo.mark_dynamic(fake, d)
    return fake


def _fake_of(mode: FakeTensorMode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.is_meta:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return mode.from_tensor(t, static_shapes=True)


def _existing_fake_mode(model: nn.Module, inputs: Sequence[Any]) -> FakeTensorMode | None:
    for t in [*model.parameters(), *model.buffers(), *inputs]:
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


@contextlib.contextmanager
def cast_at_the_edges(model: nn.Module, inputs: torch.dtype | None, outputs: torch.dtype | None) -> Iterator[None]:
    """For a capture, the forward's floating tensor arguments cast to ``inputs`` and its floating
    tensor results to ``outputs`` (None: as they are), by hooks on ``model`` that dynamo traces: the
    casts are ops of the graph, as FSDP2's ``cast_forward_inputs`` and ``output_dtype`` make them."""

    def cast(dtype: torch.dtype) -> Any:
        def one(x: Any) -> Any:
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return lambda tree: torch.utils._pytree.tree_map(one, tree)

    hooks = []
    if inputs is not None:
        into = cast(inputs)
        hooks.append(model.register_forward_pre_hook(lambda _m, a, kw: (into(a), into(kw)), with_kwargs=True))
    if outputs is not None:
        out = cast(outputs)
        hooks.append(model.register_forward_hook(lambda _m, _a, result: out(result)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
