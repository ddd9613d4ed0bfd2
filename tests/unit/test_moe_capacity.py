"""Token dropping: each expert keeps at most ``ceil(T * k / E * factor)`` (token, choice) pairs,
by highest routing weight or by earliest position; checked against a plain-Python reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshfold.ir.dialects.moe import experts

T, H, INTER, E, K = 16, 8, 6, 4, 2


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=g)
    # NOTE: skewed routing, so expert 0 is over capacity
    idx = torch.stack([torch.tensor([0, 1 + int(torch.randint(0, E - 1, (1,), generator=g))]) for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    return hidden, idx, weights, torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)


def _reference(factor: float, policy: str) -> torch.Tensor:
    hidden, idx, weights, gate_up, down = _inputs()
    cap = math.ceil(T * K / E * factor)
    keep: set[tuple[int, int]] = set()
    for e in range(E):
        pairs = [(t, j) for t in range(T) for j in range(K) if int(idx[t, j]) == e]
        if policy == "probs":
            pairs = sorted(pairs, key=lambda p: -float(weights[p]))  # NOTE: stable: ties keep position order
        keep |= set(pairs[:cap])
    out = torch.zeros(T, H)
    for t, j in sorted(keep):
        e = int(idx[t, j])
        g, u = (gate_up[e] @ hidden[t]).chunk(2)
        out[t] += weights[t, j] * (down[e] @ (F.silu(g) * u))
    return out


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_dropping_matches_reference(policy: str) -> None:
    got = experts(*_inputs(), capacity_factor=0.75, policy=policy)
    torch.testing.assert_close(got, _reference(0.75, policy), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, experts(*_inputs()), atol=1e-3), "nothing was dropped"


def test_policies_drop_different_pairs() -> None:
    assert not torch.allclose(
        experts(*_inputs(), capacity_factor=0.75), experts(*_inputs(), capacity_factor=0.75, policy="position")
    )


def test_large_capacity_is_dropless() -> None:
    torch.testing.assert_close(experts(*_inputs(), capacity_factor=float(E)), experts(*_inputs()))
