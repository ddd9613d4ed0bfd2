"""Value types: tensors with (possibly symbolic) shapes and a dtype, and symbolic scalars."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import sympy
import torch

from meshfold.ir.symbolic import Dim, dim_str

# NOTE: one short name per dtype; the printer and parser both read this table, so it is the
# single source of the text spelling.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "f8e4m3fn",
    torch.float8_e5m2: "f8e5m2",
    torch.float8_e4m3fnuz: "f8e4m3fnuz",
    torch.float8_e5m2fnuz: "f8e5m2fnuz",
    torch.complex32: "c32",
    torch.complex64: "c64",
    torch.complex128: "c128",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.uint16: "u16",
    torch.uint32: "u32",
    torch.uint64: "u64",
    torch.bool: "b8",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}


def is_float8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the 8-bit floating formats (``float8_e4m3fn``, ``float8_e5m2``...)."""
    return dtype.is_floating_point and dtype.itemsize == 1


def dtype_name(dtype: torch.dtype) -> str:
    """Short text name of a torch dtype (``f32``, ``bf16``, ``i64``...)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no meshfold spelling; add it to ir.types.DTYPE_NAMES") from None


@dataclass(frozen=True, slots=True)
class TensorType:
    """A tensor of ``shape`` (ints or sympy expressions) and ``dtype``."""

    shape: tuple[Dim, ...]
    dtype: torch.dtype

    @property
    def rank(self) -> int:
        return len(self.shape)

    def numel(self) -> Dim:
        n: Dim = 1
        for d in self.shape:
            n = n * d
        return n

    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}[{', '.join(dim_str(d) for d in self.shape)}]"


ScalarKind = Literal["int", "float", "bool", "none"]


@dataclass(frozen=True, slots=True)
class ScalarType:
    """A (symbolic) Python scalar produced by an op (a SymInt from ``aten.sym_size``), or ``none``
    for an optional tensor result the op did not compute."""

    kind: ScalarKind

    def __str__(self) -> str:
        return f"!{self.kind}"


Type = TensorType | ScalarType


def tensor_type(t: torch.Tensor) -> TensorType:
    """The type of a real, fake or meta tensor (symbolic sizes become sympy expressions)."""
    shape: list[Dim] = []
    for s in t.shape:
        if isinstance(s, torch.SymInt):
            expr = s.node.expr
            shape.append(int(expr) if isinstance(expr, sympy.Integer) else expr)
        else:
            shape.append(int(s))
    return TensorType(tuple(shape), t.dtype)


def type_of(x: object) -> Type:
    """The IR type of an op's runtime result: a tensor's type, or the kind of a (symbolic) scalar;
    ``None`` (an optional result the op did not compute) is ``!none``."""
    if isinstance(x, torch.Tensor):
        return tensor_type(x)
    if x is None:
        return ScalarType("none")
    if isinstance(x, (bool, torch.SymBool)):
        return ScalarType("bool")
    if isinstance(x, (float, torch.SymFloat)):
        return ScalarType("float")
    return ScalarType("int")
