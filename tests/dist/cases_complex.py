"""Tasks for tests/dist/test_complex.py: a model with torchtitan's complex rotary table trained under plans
whose programs move the table between ranks (``backends/collectives.py`` sends complex values as real views)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.api import parallelize
from meshfold.ir import TensorType
from meshfold.tools.pool_worker import device_mesh
from tests.dist.cases import assert_step_matches


class ComplexRope(nn.Module):
    """One attention block whose rotary embedding multiplies by a complex64 table, as torchtitan's Llama3
    does (``freqs_cis``, ``view_as_complex``/``view_as_real``), between an embedding and an output head."""

    freqs_cis: torch.Tensor

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, max_seq: int = 32) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.output = nn.Linear(dim, vocab, bias=False)
        freqs = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(max_seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def _rotated(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis).flatten(3).type_as(x)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.tok_embeddings(ids)
        q, k, v = (w(h).view(b, t, self.heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        freqs_cis = self.freqs_cis[:t].view(1, t, 1, self.head_dim // 2)
        q, k = self._rotated(q, freqs_cis), self._rotated(k, freqs_cis)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        logits = self.output(h + self.wo(y.transpose(1, 2).reshape(b, t, -1)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _rope_model() -> ComplexRope:
    torch.manual_seed(0)
    return ComplexRope()


def rope_equivalence(shape: tuple[int, ...], names: tuple[str, ...], plan: str, **options: Any) -> dict[str, Any]:
    """One step of :class:`ComplexRope` compiled with ``plan`` (and ``options``: ``memory``, ``cp``,
    ``backend``) against the single-device model: the loss and every gradient. Returns the loss, the
    comm ops that move complex values, meshfold's own ops in the program (``comm.*``, ``mem.*``, ring
    steps) and the plan report."""
    warnings.filterwarnings("ignore")
    mesh = device_mesh(shape, names)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    inputs = (ids, ids.roll(-1, 1))
    net, ref = _rope_model(), _rope_model()
    pm = parallelize(net, mesh, inputs, plan=plan, **options)
    loss = pm(*inputs)
    loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    assert_step_matches(pm, loss, ref, ref_loss)
    ops = pm.graph().ops
    out: dict[str, Any] = {
        "loss": float(loss),
        "complex_moved": sorted(
            {
                op.name
                for op in ops
                if op.name.startswith("comm.") and op.name not in ("comm.wait", "comm.shard", "comm.partial")
                for v in op.operands
                if isinstance(v.type, TensorType) and v.type.dtype.is_complex
            }
        ),
        "own_ops": sorted({op.name for op in ops if not op.name.startswith("aten.")}),
        "report": pm.plan_report(),
    }
    if options.get("backend") == "inductor":
        low = pm._mf_programs.first.lowered
        out["compiled"] = [(m.what, m.calls) for m in (low.forward, low.backward)]
    return out
