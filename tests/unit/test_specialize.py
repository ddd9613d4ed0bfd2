"""A graph planned with symbolic sizes becomes each call's static graph by substitution, checked."""

from __future__ import annotations

import pytest
import sympy

from meshfold import ir
from meshfold.ir.symbolic import divides, size_hint, size_hints

TEXT = """graph @g mesh<dp=2> {
  input %x : f32[2, s0, 8] {dp: S(0)}
  %v = aten.view(%x, [sym(2*s0), 8]) : f32[2*s0, 8] {dp: S(0)}
  %s = aten.slice.Tensor(%v, 0, 0, sym(s0)) : f32[s0, 8]
  output out(0) = %s
}
"""


def test_substituting_sizes_gives_the_static_graph() -> None:
    g = ir.specialize(ir.parse(TEXT), {"s0": 5})
    assert str(g) == str(
        ir.parse(TEXT.replace("sym(2*s0)", "10").replace("sym(s0)", "5").replace("2*s0", "10").replace("s0", "5"))
    )
    ir.verify(g)


def test_a_substitution_the_ops_refuse_is_named() -> None:
    bad = TEXT.replace("[sym(2*s0), 8]) : f32[2*s0, 8]", "[sym(2*s0), 8]) : f32[2*s0 + 1, 8]")
    with pytest.raises(ir.VerifyError, match=r"aten\.view"):
        ir.specialize(ir.parse(bad), {"s0": 5})


def test_symbolic_sizes_are_priced_at_their_hints_and_split_only_where_every_value_divides() -> None:
    s = sympy.Symbol("s0", integer=True, positive=True)
    with size_hints({"s0": 24}):
        assert size_hint(2 * s * 8) == 384
    assert size_hint(s) == 512  # NOTE: no hint: DEFAULT_HINT
    assert divides(2 * s - 2, 2) and not divides(s, 2) and divides(8, 2) and not divides(1, 2)
