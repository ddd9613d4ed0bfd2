"""A call's signature: what makes two calls need different programs, keyed alike on every rank."""

from __future__ import annotations

import torch

from meshfold.runtime.signature import Signature


def test_equal_calls_have_equal_digests_and_objects_are_keyed_by_type_not_address() -> None:
    a = Signature.of([torch.ones(2, 3), 4, [torch.ones(5), "x"], object()], training=True, grad=True)
    b = Signature.of([torch.zeros(2, 3), 4, [torch.zeros(5), "x"], object()], training=True, grad=True)
    assert a == b and a.digest() == b.digest()
    assert a.inputs[2] == ("value", "[f32[5], 'x']") and a.inputs[3] == ("value", "<builtins.object>")


def test_what_differs_is_named() -> None:
    base = Signature.of([torch.ones(8, 4, dtype=torch.float32)], training=True, grad=True)
    assert Signature.of([torch.ones(6, 4)], True, True).difference(base, ["x"]) == (
        "input 'x' has shape [6, 4]; the program was compiled for [8, 4]"
    )
    assert Signature.of([torch.ones(8, 4, dtype=torch.bfloat16)], True, True).difference(base, ["x"]) == (
        "input 'x' is bf16; the program was compiled for f32"
    )
    assert "in eval, no grad mode" in Signature.of([torch.ones(8, 4)], False, False).difference(base, ["x"])
    assert Signature.of([torch.ones(8, 4).requires_grad_()], True, True).digest() != base.digest()
