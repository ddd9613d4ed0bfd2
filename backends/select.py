"""The backend registry: how a rank's lowered program runs, by name (``parallelize(..., backend=)``).

Every backend starts from the same lowering (``backends/eager.py`` through the lowering table,
``backends/lowering/lowerings.py``) and is one registered :class:`Backend` subclass below: a name,
a one-line description, and ``run``, which loads the backend's own module (and its heavy
dependencies) only when it is called. ``backend_names()`` lists them; ``get_backend(name)`` returns
one or raises ``PassError`` naming the available ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from meshfold.passes.base import PassError

if TYPE_CHECKING:
    import torch

    from meshfold.backends.eager import Lowered, RankContext
    from meshfold.ir import Graph


class Backend:
    """One way a rank's lowered program runs. A subclass sets ``name`` and ``description`` and
    overrides :meth:`run`; ``trains = False`` marks a backend that only exports programs."""

    name: ClassVar[str]
    description: ClassVar[str]
    trains: ClassVar[bool] = True

    def run(self, graph: Graph, lowered: Lowered, rank: RankContext, device: str, what: str) -> Lowered:
        """``lowered`` (from ``graph`` for ``rank``) as this backend runs it on ``device``'s tensors;
        ``what`` names the rank in errors."""
        raise NotImplementedError


_BACKENDS: dict[str, Backend] = {}


def register(cls: type[Backend]) -> type[Backend]:
    """``@register`` above a ``Backend`` subclass adds it to the registry under its ``name``."""
    if cls.name in _BACKENDS:
        raise ValueError(f"two backends named {cls.name!r}")
    _BACKENDS[cls.name] = cls()
    return cls


@register
class Eager(Backend):
    name = "eager"
    description = "the lowered fx modules run op by op (the default)"

    def run(self, graph: Graph, lowered: Lowered, rank: RankContext, device: str, what: str) -> Lowered:
        return lowered


@register
class Inductor(Backend):
    name = "inductor"
    description = "each module compiled by TorchInductor on its first call (C++ on CPU, Triton on CUDA)"

    def run(self, graph: Graph, lowered: Lowered, rank: RankContext, device: str, what: str) -> Lowered:
        from meshfold.backends.inductor import compiled

        return compiled(lowered, what)


@register
class Ascend(Backend):
    name = "ascend"
    description = "each module as a GE graph in torchair's graph mode on Ascend NPUs"

    def run(self, graph: Graph, lowered: Lowered, rank: RankContext, device: str, what: str) -> Lowered:
        import torch

        from meshfold.backends.ascend import ge_lowered, graph_mode

        return graph_mode(ge_lowered(graph, lowered, rank, torch.device(device)), what)


@register
class Onnx(Backend):
    name = "onnx"
    description = "export only: each rank's forward written as an ONNX model (meshfold export-onnx)"
    trains = False

    def run(self, graph: Graph, lowered: Lowered, rank: RankContext, device: str, what: str) -> Lowered:
        raise PassError(
            "backend 'onnx' only exports programs, it runs no training step: compile with backend='eager' and "
            "write each rank's forward with pm.export_onnx(dir), or run `meshfold export-onnx`"
        )

    def export(
        self,
        lowered: Lowered,
        state: Mapping[str, torch.Tensor],
        inputs: Sequence[torch.Tensor],
        path: Path,
        *,
        input_names: Sequence[str],
        output_names: Sequence[str],
        metadata: Mapping[str, str],
    ) -> Path:
        """Write ``lowered``'s forward as the ONNX model ``path`` (``backends/onnx.py``'s ``export_forward``)."""
        from meshfold.backends.onnx import export_forward

        return export_forward(
            lowered, state, inputs, path, input_names=input_names, output_names=output_names, metadata=metadata
        )


def backend_names(*, training_only: bool = False) -> tuple[str, ...]:
    """The registered backends' names, in registration order; ``training_only``: only those that run
    a training step (not the export-only ones)."""
    return tuple(n for n, b in _BACKENDS.items() if b.trains or not training_only)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``PassError`` listing the available ones otherwise."""
    found = _BACKENDS.get(name)
    if found is None:
        raise PassError(f"backend {name!r} is not available; backends: {', '.join(backend_names())}")
    return found


def get_onnx() -> Onnx:
    """The ONNX exporter (``pm.export_onnx``, ``meshfold export-onnx``)."""
    found = get_backend(Onnx.name)
    assert isinstance(found, Onnx)
    return found


def select(backend: str, graph: Graph, lowered: Lowered, rank: RankContext, device: str, what: str) -> Lowered:
    """``lowered`` (from ``graph`` for ``rank``) as the backend named ``backend`` runs it
    (``get_backend(backend).run``); ``what`` names the rank in errors."""
    return get_backend(backend).run(graph, lowered, rank, device, what)


__all__ = ["Backend", "backend_names", "get_backend", "get_onnx", "register", "select"]


def check_float8(graph: Graph, device: torch.device) -> None:
    """Raise ``PassError`` naming the first float8 matmul (``aten._scaled_mm``, what torchao's
    ``Float8Linear`` captures as) when this host cannot run one on ``device`` (``float8_refusal``)."""
    import torch

    op = next((op for op in graph.ops if op.target == torch.ops.aten._scaled_mm.default), None)
    why = None if op is None else float8_refusal(device)
    if op is not None and why is not None:
        raise PassError(
            f"{op.describe()}: this host cannot run float8 matmuls on {device.type} ({why}); run on a device "
            "with float8 support (e.g. an H100), or train without torchao's float8 conversion"
        )


def float8_refusal(device: torch.device) -> str | None:
    """Why a tiny float8 matmul does not run on ``device`` here, or None when it does."""
    import torch

    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None
