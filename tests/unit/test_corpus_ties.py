"""The corpus's comparison at near ties of a top-k router (``meshfold.tools.corpus.near_ties``): a program
that broke a near tie the other way is equal once the single-device step resolves it so too, and a
program that differs in any other way still differs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from meshfold.tools.corpus import catalog as registry
from meshfold.tools.corpus import cell
from meshfold.tools.corpus.near_ties import Ties


class _Router(nn.Module):
    """Top-2 of 4 experts: expert 0 always first, 3 always last, and 1 and 2 score alike (one gate row),
    so every token's second choice is a tie between them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        tied = logits[:, 1:]
        scores = torch.cat([logits[:, :1] + 10, tied, tied, tied - 10], dim=-1).softmax(-1)
        weights, chosen = torch.topk(scores, 2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (weights * (chosen == e)).sum(-1, keepdim=True)
            out = out + w * expert(x)
        return (out**2).mean()


def _build() -> registry.Built:
    net = registry.seeded(_Router)
    return net, (torch.randn(6, 8, generator=torch.Generator().manual_seed(0)),)


ENTRY = registry.Entry("test-router", "generated", "ours", _build, traits=frozenset({"moe"}))


class _Plan:
    """Stands in for a compiled module: the model again, whose forward resolves the ties in ``flip``
    (by step) the other way, and whose gradient of ``skew`` (if any) is scaled by 1.01."""

    def __init__(self, flip: dict[int, set[tuple[int, int]]], skew: str | None = None) -> None:
        self.pm, _ = _build()
        self.flip, self.skew, self.steps = flip, skew, 0
        self.opt = torch.optim.AdamW(self.pm.parameters(), lr=cell.LR, eps=cell.EPS)

    def step(self, inputs: tuple[Any, ...]) -> torch.Tensor:
        with Ties(0.0, frozenset(self.flip.get(self.steps, ()))):
            loss = self.pm(*inputs)
        loss.backward()
        if self.skew:
            self.pm.get_parameter(self.skew).grad.mul_(1.01)
        self.steps += 1
        return loss.detach()

    def stacks(self) -> tuple[Any, ...]:
        return ()


def _compare(plan: _Plan) -> dict[str, Any]:
    ref, inputs = _build()
    first = plan.step(inputs)
    return cell._Compare(ref, ENTRY, plan, steps=3).run(inputs, first)  # type: ignore[arg-type]


def test_every_near_tie_of_a_topk_is_recorded_and_one_can_be_resolved_the_other_way() -> None:
    net, (x,) = _build()
    with Ties(1e-5) as plain:
        net(x)
    assert [(t.call, t.row, t.chosen, t.other, t.margin) for t in plain.ties] == [(0, r, 1, 2, 0.0) for r in range(6)]
    assert plain.ties[0].where == "_Router"
    with Ties(1e-5, frozenset({(0, 4)})) as flipped:
        flipped = float(net(x).detach())
    assert flipped != float(net(x).detach())


def test_a_program_that_broke_near_ties_the_other_way_is_equal_naming_them() -> None:
    got = _compare(_Plan({0: {(0, 4)}, 2: {(0, 1), (0, 3)}}))
    assert got["status"] == "equal", got
    assert got["message"].startswith("equal once 3 near ties resolved the other way: step 0: _Router: top-k row 4")
    assert "step 2: _Router: top-k row 1 took 1 over 2" in got["message"], got["message"]


def test_a_program_with_ties_resolved_alike_is_equal_with_nothing_to_name() -> None:
    assert _compare(_Plan({})) == {"status": "equal", "message": "", "loss": 0.0, "grad": 0.0}


@pytest.mark.parametrize("skew", ["experts.2.bias", "gate.weight"])
def test_a_wrong_gradient_beside_a_broken_tie_still_differs(skew: str) -> None:
    got = _compare(_Plan({0: {(0, 4)}}, skew=skew))
    # NOTE: the message is the step's first difference from the single-device step as it ran
    assert got["status"] == "differs" and got["message"].startswith("step 0: grad "), got


def _top1(pick: str, keepdim: bool) -> Any:
    """A Switch-style router's choice of one expert per token (``argmax`` or ``max`` along a dim)."""

    def choose(scores: torch.Tensor) -> torch.Tensor:
        if pick == "argmax":
            return scores.argmax(dim=-1, keepdim=keepdim)
        if pick == "argmin":
            return (-scores).argmin(dim=-1, keepdim=keepdim)
        return torch.max(scores, dim=-1, keepdim=keepdim).indices

    return choose


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("pick", ["argmax", "argmin", "max"])
def test_a_top1_router_is_a_topk_of_one(pick: str, keepdim: bool) -> None:
    scores = torch.tensor([[0.1, 0.7, 0.7 + 1e-7, 0.2], [0.9, 0.1, 0.0, 0.5], [0.3, 0.3, 0.1, 0.0]])
    choose = _top1(pick, keepdim)
    with Ties(1e-5) as plain:
        kept = choose(scores)
    # NOTE: rows 0 (1e-7 apart) and 2 (exactly equal) tie; row 1 does not
    assert [(t.row, t.chosen, t.other) for t in plain.ties] == [(0, 2, 1), (2, 0, 1)]
    with Ties(1e-5, frozenset({(0, 0)})) as flipped:
        other = choose(scores)
    assert other.shape == kept.shape == ((3, 1) if keepdim else (3,))
    assert other.flatten().tolist() == [1, 0, 0] and kept.flatten().tolist() == [2, 0, 0]
    assert len(flipped.ties) == 2


def test_a_top1_ties_values_follow_the_other_choice() -> None:
    scores = torch.tensor([[0.5, 0.5 - 1e-7], [0.0, 1.0]], requires_grad=True)
    with Ties(1e-5, frozenset({(0, 0)})):
        values, indices = scores.max(dim=-1)
    assert indices.tolist() == [1, 1]
    assert values.tolist() == pytest.approx([0.5 - 1e-7, 1.0])
    values.sum().backward()
    # NOTE: the gradient reaches the score chosen, as max's backward routes it by the indices returned
    assert scores.grad is not None and scores.grad.tolist() == [[0.0, 1.0], [0.0, 1.0]]


def test_an_argmax_over_the_whole_tensor_is_no_router() -> None:
    with Ties(1e-5) as plain:
        torch.tensor([1.0, 1.0]).argmax()
    assert plain.ties == [] and plain.calls == 0
