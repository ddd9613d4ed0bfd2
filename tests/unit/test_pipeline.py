"""Pipeline strings, option parsing, requires/ensures ordering and the between-pass callback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest

from meshfold import ir
from meshfold.passes import (
    CLEAN,
    Cleanup,
    Pass,
    PassContext,
    PassError,
    PassFailure,
    PassPipeline,
    Verify,
    default_registry,
    parse_size,
)

TEXT = """graph @g {
  input %x : f32[4]
  %a = aten.neg(%x) : f32[4]  # m fwd
  %b = aten.neg(%x) : f32[4]  # m fwd
  %c = aten.add.Tensor(%a, %b) : f32[4]  # m fwd
  output out(0) = %c
}
"""


@dataclass(frozen=True)
class NeedsClean(Pass):
    """Test pass with every option type; requires a clean graph."""

    name: ClassVar[str] = "needs-clean"
    requires: ClassVar[frozenset[str]] = frozenset({CLEAN})
    mode: Literal["seed", "auto"] = "seed"
    max_inflight: int = 1
    ratio: float = 0.5
    budget: int = 0
    enabled: bool = True

    def apply(self, ctx: PassContext, graph: ir.Graph) -> ir.Graph:
        return graph


@dataclass(frozen=True)
class Breaks(Pass):
    """Test pass that invalidates everything."""

    name: ClassVar[str] = "breaks"

    def apply(self, ctx: PassContext, graph: ir.Graph) -> ir.Graph:
        return graph


def _registry() -> dict[str, type[Pass]]:
    reg = default_registry()
    reg[NeedsClean.name] = NeedsClean
    reg[Breaks.name] = Breaks
    return reg


def test_parse_options_of_every_type() -> None:
    pipe = PassPipeline.parse(
        "cleanup{cse=false}, needs-clean{mode=auto max-inflight=2 ratio=0.25 budget=60GiB enabled=0},verify",
        _registry(),
    )
    cleanup, nc, verify = pipe.passes
    assert cleanup == Cleanup(cse=False) and isinstance(verify, Verify)
    assert nc == NeedsClean(mode="auto", max_inflight=2, ratio=0.25, budget=60 * 2**30, enabled=False)
    assert str(pipe) == (
        "cleanup{cse=false},needs-clean{mode=auto max-inflight=2 ratio=0.25 budget=64424509440 enabled=false},verify"
    )
    assert PassPipeline.parse(str(pipe), _registry()) == pipe


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope", "unknown pass 'nope'; known passes: "),
        ("cleanup{bogus=1}", "has no option 'bogus'; its options: views, cse, dce"),
        ("needs-clean{mode=fast}", "takes one of seed, auto, not 'fast'"),
        ("needs-clean{max-inflight=two}", "takes an integer or a size"),
        ("needs-clean{ratio=x}", "takes a number"),
        ("cleanup{cse=yes}", "takes true or false"),
        ("cleanup,,verify", "cannot read pipeline"),
        ("", "empty pipeline"),
    ],
)
def test_bad_pipelines_are_rejected_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(PassError, match=message.replace("(", r"\(").replace("{", r"\{")):
        PassPipeline.parse(text, _registry())


def test_order_is_checked_before_anything_runs() -> None:
    calls: list[str] = []
    pipe = PassPipeline.parse("needs-clean,cleanup", _registry())
    with pytest.raises(PassError, match=r"pass 1 \(needs-clean\) requires \['clean'\]"):
        pipe.run(PassContext(), ir.parse(TEXT), lambda i, p, g: calls.append(p.name))
    assert calls == []
    PassPipeline.parse("cleanup,needs-clean", _registry()).check()
    with pytest.raises(PassError, match="needs-clean"):
        PassPipeline.parse("cleanup,breaks,needs-clean", _registry()).check()
    # NOTE: verify keeps every property; cleanup's `clean` survives it.
    PassPipeline.parse("cleanup,verify,needs-clean", _registry()).check()


def test_callback_sees_every_pass_in_order() -> None:
    seen: list[tuple[int, str, int]] = []
    g, timings = PassPipeline.parse("verify,cleanup,verify").run(
        PassContext(), ir.parse(TEXT), lambda i, p, gr: seen.append((i, p.name, len(gr.ops)))
    )
    assert seen == [(0, "verify", 3), (1, "cleanup", 2), (2, "verify", 2)]
    assert [t.name for t in timings] == ["verify", "cleanup", "verify"]
    assert "%c = aten.add.Tensor(%a, %a)" in str(g)


def test_a_failing_pass_is_named_with_its_position() -> None:
    bad = ir.parse(TEXT.replace("%c = aten.add.Tensor(%a, %b) : f32[4]", "%c = aten.add.Tensor(%a, %b) : f32[5]"))
    # NOTE: cleanup rebuilt the graph; the add kept its provenance, so the error still names its text line
    failed = r"pass 2 \(verify\) failed: VerifyError: line 5, column 3: aten.add.Tensor at m"
    with pytest.raises(PassFailure, match=failed) as info:
        PassPipeline.parse("cleanup{cse=false},verify").run(PassContext(), bad)
    assert info.value.index == 1 and isinstance(info.value.__cause__, ir.VerifyError)


def test_passes_are_frozen_and_registry_is_fresh() -> None:
    with pytest.raises(AttributeError):
        Cleanup().cse = False  # type: ignore[misc]
    reg = default_registry()
    reg["x"] = NeedsClean
    assert "x" not in default_registry()


def test_parse_size() -> None:
    assert parse_size("60GiB") == 60 * 2**30 and parse_size("1.5KB") == 1500 and parse_size("12") == 12
    with pytest.raises(PassError):
        parse_size("lots")
