"""``meshfold.rewrites.fold_scan``: a loop over chunks whose carried state each body updates linearly becomes one
``meshfold.affine_scan`` at capture (computing the same), and any other loop is left as it is; the op's
gradient; its steps split over ranks (``backends/context_parallel/split_scans.py``) give the same states and
gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshfold import capture
from meshfold.ir.dialects.scan import affine_scan_backward, scan
from tests.models.test_capture import assert_graph_matches_eager

SCAN_OPS = {"meshfold.affine_scan", "meshfold.affine_scan_backward"}


class Chunked(nn.Module):
    """A gated delta rule run chunk by chunk, written the way HF's fallback writes it: per chunk, the
    new values less what the state already predicts, the output read from the state plus the
    chunk's own (masked) attention, the state decayed and updated. ``step`` picks a variant:
    ``"delta"``, ``"final"`` (the delta rule whose last state the loss reads too), ``"decay"`` (the
    scalar-decay linear attention: no delta correction), ``"right"``
    (the state multiplied from the right: not a left-affine update), ``"tanh"`` (nonlinear),
    ``"reduced"`` (an output summed over a dim: a form this pass does not batch, met only after the
    scan is emitted, so the loop must come out as it went in),
    ``"selective"`` (a state-space scan token by token, as HF's Mamba runs it without its kernels:
    every state entry decays by its own factor, the output reads the state from the right, stacked
    after the loop)."""

    def __init__(self, step: str = "delta", chunk: int = 4, k: int = 4, v: int = 6) -> None:
        super().__init__()
        self.step, self.chunk, self.k, self.v = step, chunk, k, v
        self.proj = nn.Linear(8, 2 * k + v + 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        n, c, k = t // self.chunk, self.chunk, self.k
        q, key, val, beta, gate = self.proj(x).split([k, k, self.v, 1, 1], -1)
        q, key, val = (y.reshape(b, n, c, -1) for y in (q.softmax(-1), key.softmax(-1), val))
        beta = beta.sigmoid().reshape(b, n, c, 1)
        decay = torch.sigmoid(gate.reshape(b, n, c).sum(-1) + 2.0)[..., None, None]  # [b, n, 1, 1]
        attn = (q @ key.transpose(-1, -2)).tril()
        state = torch.zeros(b, k, self.v) if self.step != "right" else torch.zeros(b, k, k)
        out = torch.zeros(b, n, c, self.v)
        if self.step == "selective":
            d_a = torch.exp(-F.softplus(val.reshape(b, t, self.v)))[..., None].expand(b, t, self.v, k)
            d_bu = val.reshape(b, t, self.v)[..., None] * key.reshape(b, t, k)[:, :, None, :]
            s, ys, q = torch.zeros(b, self.v, k), [], q.reshape(b, t, k)
            for i in range(t):
                s = d_a[:, i] * s + d_bu[:, i]
                ys.append((s @ q[:, i, :, None])[:, :, 0])
            return torch.stack(ys, dim=-1).square().mean()
        for i in range(n):
            if self.step in ("delta", "final"):
                v_new = val[:, i] - (key[:, i] * beta[:, i]) @ state
                out[:, i] = q[:, i] @ state + attn[:, i] @ v_new
                state = state * decay[:, i] + key[:, i].transpose(-1, -2) @ v_new
            elif self.step == "decay":
                out[:, i] = q[:, i] @ state + attn[:, i] @ val[:, i]
                state = decay[:, i] * state + key[:, i].transpose(-1, -2) @ val[:, i]
            elif self.step == "reduced":  # NOTE: an output this pass cannot batch, found after the update
                out[:, i] = (q[:, i] @ state).sum(-1, keepdim=True)
                state = state * decay[:, i] + key[:, i].transpose(-1, -2) @ val[:, i]
            elif self.step == "right":
                out[:, i] = (q[:, i] @ state) @ key[:, i].transpose(-1, -2) @ val[:, i]
                state = state @ (key[:, i].transpose(-1, -2) @ key[:, i]) * decay[:, i]
            else:
                out[:, i] = q[:, i] @ state
                state = torch.tanh(state * decay[:, i] + key[:, i].transpose(-1, -2) @ val[:, i])
        final = state.sum() * 0.1 if self.step == "final" else 0.0  # NOTE: the state after the loop, read
        return out.square().mean() + final


def _built(step: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Chunked(step), (torch.randn(2, 16, 8),)


@pytest.mark.parametrize("step", ["delta", "decay", "selective", "final"])
def test_affine_loop_is_one_scan_and_computes_the_same(step: str) -> None:
    model, inputs = _built(step)
    g = capture(model, inputs)
    names = [op.name for op in g.ops]
    assert names.count("meshfold.affine_scan") == 1 and names.count("meshfold.affine_scan_backward") == 1
    scans = [op for op in g.ops if op.name.startswith("meshfold.affine_scan")]
    # NOTE: the delta rule's update is a matrix on the left; a scalar decay and the selective scan's
    # element-by-element decay are diagonal (the cheaper form)
    assert all((True in op.args) == (step in ("decay", "selective")) for op in scans), scans
    # NOTE: the bodies are gone: no op reads a chunk (or token) by index any more, only size-1 dims and
    # (where the model reads it) the state after the last step
    selects = [op for op in g.ops if op.name == "aten.select.int" and op.prov.phase == "fwd"]
    picks = [op for op in selects if op.args[2] != -1]
    assert bool([op for op in selects if op.args[2] == -1]) == (step == "final"), selects
    assert all(op.operands[0].type.shape[op.args[1]] == 1 for op in picks), picks
    scan_op = next(op for op in g.ops if op.name == "meshfold.affine_scan")
    assert scan_op.prov.source.startswith("test_fold_scan.py:") and scan_op.prov.phase == "fwd"
    assert_graph_matches_eager(g, *_built(step))


@pytest.mark.parametrize("step", ["right", "tanh", "reduced"])
def test_other_loops_are_left_as_they_are(step: str) -> None:
    model, inputs = _built(step)
    g = capture(model, inputs)
    assert not SCAN_OPS & {op.name for op in g.ops}
    assert_graph_matches_eager(g, *_built(step))


def test_scan_gradient_is_the_recurrence_run_back() -> None:
    torch.manual_seed(0)
    m = (0.4 * torch.randn(2, 5, 3, 3, dtype=torch.float64)).requires_grad_()
    b = torch.randn(2, 5, 3, 4, dtype=torch.float64, requires_grad=True)
    s0 = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(torch.ops.meshfold.affine_scan, (m, b, s0))
    h = torch.ops.meshfold.affine_scan(m, b, s0)
    torch.testing.assert_close(h[:, 0], s0)
    torch.testing.assert_close(h[:, 3], m[:, 2] @ (m[:, 1] @ h[:, 1] + b[:, 1]) + b[:, 2])
    grad = torch.randn_like(h)
    dm, db, ds0 = affine_scan_backward(m.detach(), h.detach(), grad)
    torch.testing.assert_close(torch.autograd.grad(h, (m, b, s0), grad), (dm, db, ds0))


def test_a_malformed_scan_names_the_shapes_it_takes() -> None:
    with pytest.raises(ValueError, match=r"m \[\*, n, k, k\].*got m \[2, 3, 3, 3\], b \[2, 3, 4, 5\]"):
        torch.ops.meshfold.affine_scan(torch.zeros(2, 3, 3, 3), torch.zeros(2, 3, 4, 5), torch.zeros(2, 4, 5))
    assert scan(torch.zeros(1, 0, 2, 2), torch.zeros(1, 0, 2, 3), torch.zeros(1, 2, 3)).shape == (1, 0, 2, 3)


def test_scan_and_causal_conv_kernels_return_the_strides_their_fakes_say() -> None:
    """A compiler plans the buffers after a custom op by its fake's strides: on inputs laid out
    transposed (Mamba's conv input is [B, L, C] transposed) the real kernels must agree."""
    from meshfold.ir.dialects import conv, scan

    x = torch.randn(2, 5, 3).transpose(1, 2)  # [B, C, L], not contiguous
    w, bias = torch.randn(3, 1, 4), torch.randn(3)
    torch.library.opcheck(conv.causal_conv1d, (x, w, bias), test_utils=("test_faketensor",))
    b = torch.randn(2, 3, 4, 6).permute(0, 2, 3, 1)  # [*, n, k, v] = [2, 4, 6, 3], not contiguous
    m = torch.rand(2, 4, 6, 3) * 0.5
    s0 = torch.randn(2, 6, 3)
    torch.library.opcheck(scan.affine_scan, (m, b, s0, True), test_utils=("test_faketensor",))
