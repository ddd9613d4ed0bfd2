"""Experts in an ``nn.ModuleList``: which forms capture folds into the experts op (and with what
numbers), and which it leaves replicated with a warning naming the layer."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshfold import capture
from meshfold.ir.dialects.moe import EXPERTS
from tests.models.test_capture import assert_graph_matches_eager

H, INTER, E, K, VOCAB = 16, 8, 4, 2, 32


class Expert(nn.Module):
    """A gated MLP with its own names; ``act`` and ``bias`` vary the form."""

    def __init__(self, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.act = act
        self.inp = nn.Linear(H, INTER, bias=bias)
        self.gate = nn.Linear(H, INTER, bias=bias)
        self.out = nn.Linear(INTER, H, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        g = F.gelu(g, approximate="tanh") if self.act == "gelu_tanh" else F.silu(g)
        return self.out(self.inp(x) * g)  # NOTE: up first, gate second: roles come from the wiring


class LoopMoe(nn.Module):
    """An LM with one MoE layer in the per-expert loop form; ``combine`` picks how outputs are added,
    ``dispatch`` how the loop finds an expert's tokens: ``where-eq`` (``torch.where(top_i == e)``),
    ``one-hot`` (transformers v4 Mixtral's ``one_hot(top_i).permute(2, 1, 0)`` mask, its gather and
    cast), ``one-hot-tk`` (the mask permuted token-major, ``permute(2, 0, 1)``)."""

    def __init__(
        self, act: str = "silu", bias: bool = False, combine: str = "index_add", dispatch: str = "where-eq"
    ) -> None:
        super().__init__()
        self.combine = combine
        self.dispatch = dispatch
        self.embed = nn.Embedding(VOCAB, H)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert(act, bias) for _ in range(E))
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = self.embed(ids).reshape(-1, H)
        top_w, top_i = torch.topk(F.softmax(self.router(flat), dim=-1), K, dim=-1)
        if self.combine == "dense":
            dense_w = torch.zeros_like(top_w.new_empty(flat.size(0), E)).scatter(1, top_i, top_w)
            every = torch.stack([expert(flat) for expert in self.experts], dim=1)
            return F.cross_entropy(self.head((dense_w.unsqueeze(-1) * every).sum(dim=1) + flat), ids.reshape(-1))
        out = torch.zeros_like(flat)
        if self.dispatch != "where-eq":
            self._add_one_hot(out, flat, top_w, top_i)
            return F.cross_entropy(self.head(out + flat), ids.reshape(-1))
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(top_i == e)
            y = expert(flat[rows]) * top_w[rows, slot, None]
            if self.combine == "index_add":
                out.index_add_(0, rows, y)
            else:
                out = out.index_put((rows,), y, accumulate=True)
        return F.cross_entropy(self.head(out + flat), ids.reshape(-1))

    def _add_one_hot(self, out: torch.Tensor, flat: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> None:
        if self.dispatch == "one-hot":
            mask = F.one_hot(top_i, num_classes=E).permute(2, 1, 0)
            for e, expert in enumerate(self.experts):
                slot, rows = torch.where(mask[e])
                y = expert(flat[None, rows].reshape(-1, H)) * top_w[rows, slot, None]
                out.index_add_(0, rows, y.to(flat.dtype))
        else:
            mask = F.one_hot(top_i, num_classes=E).permute(2, 0, 1)
            for e, expert in enumerate(self.experts):
                rows, slot = torch.where(mask[e])
                out.index_add_(0, rows, expert(flat[rows]) * top_w[rows, slot, None])


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _capture_recording(model: nn.Module) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = capture(model, (_ids(),))
    return g, [str(w.message) for w in caught if "MoE layer" in str(w.message)]


def _program(g: object) -> list[str]:
    """``g``'s text without the provenance comments (module, phase, source line)."""
    return [line.split("  # ", 1)[0] for line in str(g).splitlines()]


@pytest.mark.parametrize(("act", "combine"), [("silu", "index_add"), ("gelu_tanh", "index_add"), ("silu", "dense")])
def test_experts_with_their_own_names_fold_and_match_eager(act: str, combine: str) -> None:
    torch.manual_seed(0)
    model = LoopMoe(act, combine=combine)
    g, notes = _capture_recording(model)
    assert notes == []
    (op,) = [op for op in g.ops if op.target == EXPERTS]  # type: ignore[attr-defined]
    assert op.args[5] == act
    (gate_up, down) = g.stacks  # type: ignore[attr-defined]
    assert gate_up.members[2] == ("experts.2.gate.weight", "experts.2.inp.weight")
    assert down.members[0] == ("experts.0.out.weight",)
    assert_graph_matches_eager(g, model, (_ids(),))  # type: ignore[arg-type]


@pytest.mark.parametrize("dispatch", ["one-hot", "one-hot-tk"])
def test_a_one_hot_mask_loop_folds_like_the_where_eq_loop(dispatch: str) -> None:
    """The one-hot mask's ``torch.where`` selects the same tokens of each expert as ``top_i == e``: the
    captured program is the where-eq loop's, op for op (one experts op on the same stacks, the mask
    gone), and its loss and gradients equal the eager model's."""
    torch.manual_seed(0)
    model = LoopMoe(dispatch=dispatch)
    g, notes = _capture_recording(model)
    assert notes == []
    reference, _ = _capture_recording(LoopMoe())
    assert _program(g) == _program(reference)
    assert [op.target for op in g.ops].count(EXPERTS) == 1  # type: ignore[attr-defined]
    assert_graph_matches_eager(g, model, (_ids(),))  # type: ignore[arg-type]


def test_experts_with_biases_stay_replicated_with_a_warning() -> None:
    g, notes = _capture_recording(LoopMoe(bias=True, combine="dense"))
    assert len(notes) == 1 and "MoE layer <root>" in notes[0] and "stay replicated" in notes[0]
    assert g.stacks == () and not any(op.target == EXPERTS for op in g.ops)  # type: ignore[attr-defined]


def test_an_unknown_combine_stays_replicated_with_a_warning_naming_why() -> None:
    """Outputs added with index_put(accumulate=True) are not a form the matcher knows: nothing is
    folded, and the data-dependent loop then cannot be captured; the error says why and what to do."""
    from meshfold import CaptureError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CaptureError, match=r"shapes that depend on the data.*test_moe_lists\.py:"):
            capture(LoopMoe(combine="index_put"), (_ids(),))
    notes = [str(w.message) for w in caught if "MoE layer" in str(w.message)]
    assert len(notes) == 1 and "combined in a way meshfold does not recognize" in notes[0]
