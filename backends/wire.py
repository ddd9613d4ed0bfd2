"""How values of every dtype cross a collective (``backends/collectives.py``'s lowering of ``comm.*`` ops).

gloo's collectives take no complex tensor (its all-to-all, which gloo's all-gathers and sum
reduce-scatters are sent as, least of all), nor do NCCL's; ``torch.distributed``'s own collectives send
complex values as real views (``torch.view_as_real``), and so does meshfold's lowering: a complex
operand is viewed as real before the collective's layout work, with a trailing dim of 2 (its real and
imaginary parts), and the results are viewed as complex after the wait. A gather, an all-to-all, a
permute, a sum and a mean of the real view are those of the complex values; a max of them has no
meaning, and neither have a sum of bools nor a mean of integers (``ir.placement.reduce_refusal``):
those are refused, naming the op, while the program is lowered, before any collective runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from meshfold.ir import Op, TensorType, is_float8
from meshfold.ir.placement import reduce_refusal

aten = torch.ops.aten


def complex_operands(op: Op) -> list[bool]:
    """For each operand of the comm op ``op``: whether it crosses as a real view (a complex tensor).
    Raises ``ValueError`` naming ``op`` when it reduces an operand whose dtype has no such reduction."""
    reduce = op.kwarg("reduce")
    out = []
    for v in op.operands:
        dtype = v.type.dtype if isinstance(v.type, TensorType) else None
        why = reduce_refusal(str(reduce), dtype) if reduce is not None and dtype is not None else None
        if why is not None:  # NOTE: the verifier refuses it too; a program lowered unverified stops here
            raise ValueError(f"{op.describe()}: {op.name}(reduce={reduce!r}) of %{v.name}: {v.type}: {why}")
        out.append(dtype is not None and dtype.is_complex)
    return out


def as_real(
    g: fx.Graph, xs: Sequence[fx.Node], local: Sequence[list[int]], which: Sequence[bool]
) -> tuple[list[fx.Node], list[list[int]]]:
    """The operands ``which`` says (``complex_operands``) viewed as real, and every operand's local
    shape as sent. NOTE: the dim of 2 trails every dim a comm op names, so none of those moves."""
    real = [g.call_function(aten.view_as_real.default, (x,)) if c else x for x, c in zip(xs, which, strict=True)]
    return real, [[*s, 2] if c else list(s) for s, c in zip(local, which, strict=True)]


def as_complex(g: fx.Graph, outs: Sequence[fx.Node], which: Sequence[bool]) -> list[fx.Node]:
    """A comm op's results, those of its complex operands (``which``) viewed as complex again."""
    return [g.call_function(aten.view_as_complex.default, (o,)) if c else o for o, c in zip(outs, which, strict=True)]


def float8_operands(op: Op) -> list[bool]:
    """For each operand of the comm op ``op``: whether it is float8, which no collective takes (gloo
    refuses the dtype): such values cross as their bytes (``uint8`` views of the same shape), which a
    collective that only moves values (a gather, an all-to-all, a permute) moves unchanged."""
    return [isinstance(v.type, TensorType) and is_float8(v.type.dtype) for v in op.operands]


def as_bytes(g: fx.Graph, xs: Sequence[fx.Node], which: Sequence[bool]) -> list[fx.Node]:
    """The operands ``which`` says (``float8_operands``) viewed as ``uint8``."""
    return [g.call_function(aten.view.dtype, (x, torch.uint8)) if b else x for x, b in zip(xs, which, strict=True)]


def from_bytes(g: fx.Graph, outs: Sequence[fx.Node], dtypes: Sequence[torch.dtype | None]) -> list[fx.Node]:
    """A comm op's results, those of its float8 operands viewed as their ``dtypes`` again."""
    return [o if d is None else g.call_function(aten.view.dtype, (o, d)) for o, d in zip(outs, dtypes, strict=True)]
