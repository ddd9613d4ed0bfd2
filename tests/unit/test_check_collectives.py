"""``verify`` checks collectives too: each one changes only its own axis, the way its kind says."""

from __future__ import annotations

import pytest

from meshfold import ir
from meshfold.passes.sharding.check import check_layouts

GOOD = """graph @g mesh<dp=2, tp=2> {
  input %x : f32[8, 16] {tp: P(sum)}
  input %y : f32[8, 16] {dp: S(0), tp: S(0)}
  input %z : f32[8, 16] {tp: S(0)}
  %a = comm.reduce_scatter(%x, axis="tp", dim=1, reduce="sum") : f32[8, 16] {tp: S(1)}  # m fwd
  %b = comm.all_gather(%y, axis="tp", dim=0) : f32[8, 16] {dp: S(0)}  # m fwd
  %c = comm.all_to_all(%z, axis="tp", concat_dim=0, split_dim=1) : f32[8, 16] {tp: S(1)}  # m fwd
  %d = comm.all_reduce(%x, axis="tp", reduce="sum") : f32[8, 16]  # m fwd
  %e, %f = comm.all_gather_bucket(%y, %z, axis="tp", dims=[0, 0]) : f32[8, 16] {dp: S(0)}, f32[8, 16]  # m fwd
  output out(0) = %a
  output out(1) = %b
  output out(2) = %c
  output out(3) = %d
  output out(4) = %e
  output out(5) = %f
}
"""

BAD = [
    # the gather forgot the dp shard it does not touch
    (
        '%b = comm.all_gather(%y, axis="tp", dim=0) : f32[8, 16] {dp: S(0)}',
        '%b = comm.all_gather(%y, axis="tp", dim=0) : f32[8, 16]',
    ),
    # a reduce-scatter must leave its result sharded on the dim it names
    ("{tp: S(1)}  # m fwd\n  %b", "{tp: S(0)}  # m fwd\n  %b"),
    # all-to-all: split dim 1, not 0
    ("split_dim=1) : f32[8, 16] {tp: S(1)}", "split_dim=1) : f32[8, 16] {tp: S(0)}"),
    # bucket operand 1 is gathered along dim 0 over tp, so its result is replicated
    ("f32[8, 16] {dp: S(0)}, f32[8, 16]  # m fwd", "f32[8, 16] {dp: S(0)}, f32[8, 16] {tp: S(0)}  # m fwd"),
]


def test_consistent_collectives_pass() -> None:
    check_layouts(ir.parse(GOOD))


@pytest.mark.parametrize("edit", BAD, ids=["other-axis", "reduce-scatter-dim", "all-to-all", "bucket"])
def test_inconsistent_collective_is_named(edit: tuple[str, str]) -> None:
    old, new = edit
    assert GOOD.count(old) == 1
    with pytest.raises(ir.VerifyError, match=r"comm\.\w+ at m \(fwd\).*inconsistent layouts"):
        check_layouts(ir.parse(GOOD.replace(old, new)))


STACK = """graph @g mesh<tp=2> {
  input %x : f32[8, 16]
  input %w0 : f32[16, 16] {tp: S(1)}
  input %w1 : f32[16, 16] {tp: S(1)}
  input %w2 : f32[16, 16] {tp: S(1)}
  %a = aten.mm(%x, %w0) : f32[8, 16] {tp: S(1)}  # layers.0 fwd
  %b = comm.all_gather(%a, axis="tp", dim=1) : f32[8, 16]  # layers.0 fwd
  %c = aten.mm(%b, %w1) : f32[8, 16] {tp: S(1)}  # layers.1 fwd
  %d = comm.all_gather(%c, axis="tp", dim=1) : f32[8, 16]  # layers.1 fwd
  %e = aten.mm(%d, %w2) : f32[8, 16] {tp: S(1)}  # layers.2 fwd
  output out(0) = %e
}
"""


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        # the last layer's product claims a layout its rule does not give: same op key, other layouts
        (
            "%e = aten.mm(%d, %w2) : f32[8, 16] {tp: S(1)}",
            "%e = aten.mm(%d, %w2) : f32[8, 16] {tp: S(0)}",
            r"aten\.mm at layers\.2 .*not a strategy of its sharding rule",
        ),
        # the last layer's product declares a type the op does not compute: another op key
        (
            "%e = aten.mm(%d, %w2) : f32[8, 16] {tp: S(1)}",
            "%e = aten.mm(%d, %w2) : f32[8, 17] {tp: S(1)}",
            r"aten\.mm at layers\.2 .*declared f32\[8, 17\]",
        ),
    ],
    ids=["layout", "type"],
)
def test_checks_shared_by_repeated_layers_still_see_a_layer_that_differs(old: str, new: str, message: str) -> None:
    """The verifier and the layout check decide once per op key (and layouts), so layers 1 and 2
    repeat layer 0's verdict; a later layer that differs is still refused, by its own line."""
    g = ir.parse(STACK)
    ir.verify(g)
    check_layouts(g)
    bad = ir.parse(STACK.replace(old, new))
    with pytest.raises(ir.VerifyError, match=message):
        ir.verify(bad)
        check_layouts(bad)
