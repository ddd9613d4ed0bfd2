"""Random ops on a rank draw the whole tensor's values from the program's generator and keep their
shard: the ranks' pieces put together are the single-device model's draw with the same seed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshfold import ir
from meshfold.backends.random import RandomSite, is_random, random_site
from meshfold.passes.options import Options
from meshfold.session import compile_model


class _Drop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drop(x * 2.0), torch.rand_like(x) + x


def _compiled(model: nn.Module, x: torch.Tensor, mesh: str) -> ir.Graph:
    options = Options.of(
        mesh=mesh, plan="tp" if mesh.startswith("tp") else "ddp", pipeline="cleanup,sharding,boxing,verify"
    )
    return compile_model(model, (x,), options).graph


def _sites(graph: ir.Graph, coord: tuple[int, ...], seed: int) -> list[RandomSite]:
    """This rank's callables for the graph's random ops, all on one generator seeded ``seed``."""
    assert graph.mesh is not None
    rng = torch.Generator().manual_seed(seed)
    return [random_site(op, rng, graph.mesh, coord) for op in graph.ops if is_random(op)]


def test_each_rank_keeps_its_rows_of_the_single_device_draw() -> None:
    x = torch.randn(8, 6)
    graph = _compiled(_Drop(), x, "dp=2")
    drops, rands = [], []
    for rank in (0, 1):
        dropout, rand_like = _sites(graph, (rank,), seed=7)  # NOTE: every rank's generator has one state
        local = x.chunk(2)[rank]
        drops.append(dropout(local * 2.0, 0.4, True)[0])
        rands.append(rand_like(local) + local)
    torch.manual_seed(7)
    want_drop, want_rand = _Drop()(x)
    torch.testing.assert_close(torch.cat(drops), want_drop)
    torch.testing.assert_close(torch.cat(rands), want_rand)


def test_a_replicated_draw_is_the_same_on_every_rank() -> None:
    x = torch.randn(8, 6)
    graph = _compiled(_Drop(), x, "tp=2")
    outs = [_sites(graph, (rank,), seed=3)[0](x, 0.4, True)[0] for rank in (0, 1)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert bool((outs[0] == 0).any())


class _Attention(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=self.p).sum()


def test_fused_attention_dropout_is_refused_by_name_and_without_it_is_deterministic() -> None:
    q = torch.randn(2, 2, 4, 8)
    plain = _compiled(_Attention(0.0), q, "dp=2")
    assert not any(is_random(op) for op in plain.ops)
    mesh = ir.Mesh(("dp",), (2,))
    b = ir.GraphBuilder("attention", mesh)
    v = b.add_input("input", "q", ir.TensorType((2, 2, 4, 8), torch.float32))
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    b.add_op(fused, (v, v, v, 0.1), (), [("o", ir.TensorType((2, 2, 4, 8), torch.float32))])
    (op,) = b.build().ops
    assert is_random(op)
    with pytest.raises(ValueError, match=r"applies dropout inside a fused attention kernel.*attention dropout to 0"):
        random_site(op, torch.Generator(), mesh, (0,))


class _Samplers(nn.Module):
    """The in-place samplers real code calls on a fresh tensor (PhiMoE's router draws Gumbel noise
    as ``empty_like(scores).exponential_().log()``)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gumbel = x - torch.empty_like(x).exponential_().log()
        return gumbel, torch.empty_like(x).uniform_(-1.0, 2.0) * x, torch.empty_like(x).normal_(1.0, 3.0) + x


def test_in_place_samplers_split_like_the_single_device_draw() -> None:
    x = torch.randn(8, 6)
    graph = _compiled(_Samplers(), x, "dp=2")
    names = sorted(site.name for site in _sites(graph, (0,), seed=0))
    assert names == ["exponential", "normal", "uniform"]
    pieces: list[list[torch.Tensor]] = [[], [], []]
    for rank in (0, 1):
        sites = {site.name: site for site in _sites(graph, (rank,), seed=11)}
        local = x.chunk(2)[rank]
        pieces[0].append(local - sites["exponential"](torch.empty_like(local), 1.0).log())
        pieces[1].append(sites["uniform"](torch.empty_like(local), -1.0, 2.0) * local)
        pieces[2].append(sites["normal"](torch.empty_like(local), 1.0, 3.0) + local)
    torch.manual_seed(11)
    for got, want in zip(pieces, _Samplers()(x), strict=True):
        torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=0)


class _Poisson(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.poisson(x.abs()) + x


def test_a_random_op_without_a_split_form_is_refused_naming_it_and_its_line() -> None:
    from meshfold.passes.base import PassError

    graph = _compiled(_Poisson(), torch.randn(8, 6), "dp=2")
    (op,) = [op for op in graph.ops if is_random(op)]
    with pytest.raises(PassError, match=r"aten\.poisson.*test_random\.py:\d+.*no split form.*pass them in"):
        random_site(op, torch.Generator(), graph.mesh, (0,))  # type: ignore[arg-type]
