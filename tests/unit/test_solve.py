"""The sharding solve finds known optima on small graphs (no ranks needed; numerics are checked
for auto plans on ranks in tests/dist)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from meshfold import capture, ir
from meshfold.ir import Layout
from meshfold.passes import PassContext, PassError, parse_pipeline
from meshfold.passes.cost import comm
from meshfold.passes.cost.axis import axis_models
from meshfold.passes.options import Options
from meshfold.passes.sharding.batch import BatchSplit
from meshfold.passes.sharding.ilp.solve import Problem, solve
from meshfold.passes.sharding.plans import Plan
from meshfold.target.hardware import parse_cluster


class _MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(nn.functional.gelu(self.fc1(x))), t)


def _auto_ctx(
    d: int, tokens: int, mesh: str, cluster: str | None, memory: float | None
) -> tuple[dict[str, ir.Layout], PassContext]:
    with torch.device("meta"):
        model = _MLP(d)
    g = capture(model, (torch.empty(tokens, d), torch.empty(tokens, d)))
    ctx = PassContext(
        Options(
            mesh=ir.Mesh.parse(mesh),
            plan=Plan.of("auto"),
            cluster=parse_cluster(cluster) if cluster else None,
            memory=memory,
        )
    )
    out, _ = parse_pipeline("cleanup,sharding,boxing,verify").run(ctx, g)
    return {i.name: i.value.layout for i in out.inputs}, ctx


def _auto(d: int, tokens: int, mesh: str, cluster: str | None, memory: float | None) -> dict[str, ir.Layout]:
    return _auto_ctx(d, tokens, mesh, cluster, memory)[0]


def test_mlp_on_a_2d_mesh_gets_megatron_column_then_row() -> None:
    # NOTE: 8192 tokens x 4096 hidden on H100s: each matmul is ~0.3 TFLOP, worth splitting 8 ways;
    # column-then-row needs one all-reduce of the output where any other split moves more.
    lay = _auto(4096, 8192, "a=2,b=4", "h100:8x1", None)
    for axis in ("a", "b"):
        assert lay["fc1.weight"].placement(axis) == ir.Shard(0), lay
        assert lay["fc2.weight"].placement(axis) == ir.Shard(1), lay


def test_small_mlp_replicates_until_memory_forces_sharding() -> None:
    # NOTE: on gloo CPU ranks a collective (~1 ms) costs more than this MLP's matmuls.
    free = _auto(64, 8, "dp=4", None, None)
    assert all(not any(isinstance(p, ir.Shard) for p in lay.placements) for lay in free.values()), free
    state = 2 * 64 * 256 * 4 * 4  # two weights, fp32, with gradient and two Adam moments
    bounded = _auto(64, 8, "dp=4", None, state / 3)
    sharded = [n for n in ("fc1.weight", "fc2.weight") if isinstance(bounded[n].placement("dp"), ir.Shard)]
    assert sharded == ["fc1.weight", "fc2.weight"], bounded


def test_auto_says_where_it_trades_data_parallelism_away() -> None:
    # NOTE: 8 tokens: every gloo rank computes the whole (tiny) batch rather than pay for collectives;
    # 4096 tokens: the matmuls are worth splitting by batch, and nothing is said.
    lay, small = _auto_ctx(64, 8, "dp=4", None, None)
    splits = small.stats["sharding.batch"]
    assert isinstance(splits, tuple)
    (split,) = splits
    assert isinstance(split, BatchSplit) and not split.data_parallel
    assert (split.axis, split.split, split.whole) == ("dp", (), ("x", "t")), split
    assert lay["x"].placement("dp") == ir.Replicate()
    assert [d for d in small.diagnostics if "trades data parallelism away on mesh axis 'dp'" in d], small.diagnostics

    lay, big = _auto_ctx(64, 4096, "dp=4", None, None)
    splits = big.stats["sharding.batch"]
    assert isinstance(splits, tuple)
    (split,) = splits
    assert isinstance(split, BatchSplit) and split.data_parallel, split
    assert lay["x"].placement("dp") == ir.Shard(0)
    assert not [d for d in big.diagnostics if "data parallelism" in d], big.diagnostics


def test_an_impossible_memory_bound_says_so() -> None:
    with pytest.raises(PassError, match="memory bound"):
        _auto(64, 8, "dp=4", None, 1024)


class _Stack(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(x, t)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def _stack_solve(share: bool, layers: int) -> tuple[dict[str, ir.Layout], tuple[object, ...]]:
    # NOTE: big enough that sharding every layer clearly pays on H100s (a kernel's fixed launch and
    # fill time does not divide over ranks): at 1024 x 4096 the choice for layers 1-3 is a near
    # tie, and whether their columns are shared may tip it.
    with torch.device("meta"):
        model = _Stack(2048, layers)
    g = capture(model, (torch.empty(8192, 2048), torch.empty(8192, 2048)))
    ctx = PassContext(Options(mesh=ir.Mesh.parse("a=2,b=4"), plan=Plan.of("auto"), cluster=parse_cluster("h100:8x1")))
    pipe = f"cleanup,sharding{{share-blocks={'true' if share else 'false'}}},boxing,verify"
    out, _ = parse_pipeline(pipe).run(ctx, g)
    stats = ctx.stats["sharding.solve"]
    assert isinstance(stats, tuple)
    return {i.name: i.value.layout for i in out.inputs}, stats


def test_repeated_blocks_share_variables_and_keep_the_optimum() -> None:
    shared, s_stats = _stack_solve(True, 4)
    alone, a_stats = _stack_solve(False, 4)
    assert shared == alone
    for s, a in zip(s_stats, a_stats, strict=True):
        # NOTE: blocks 2 and 3 reuse block 1's columns (block 0 differs: its input needs no gradient)
        assert s.shared_ops > 0 and a.shared_ops == 0, (s, a)
        assert s.binaries < 0.6 * a.binaries, (s, a)
        # NOTE: one plan for every layer may cost a little over per-layer freedom, never less
        assert a.objective * (1 - 1e-4) <= s.objective <= a.objective * 1.01, (s, a)
    for name, lay in shared.items():
        if name.startswith(("layers.2.", "layers.3.")):
            assert lay == shared["layers.1." + name.split(".", 2)[2]], name


def test_program_size_barely_grows_with_depth() -> None:
    _, four = _stack_solve(True, 4)
    _, eight = _stack_solve(True, 8)
    for a, b in zip(four, eight, strict=True):
        # NOTE: only the backward's residual-gradient sums, which capture attributes to no module,
        # add binaries per layer (one op each); a layer's own ops add none
        assert b.shared_ops == a.shared_ops + 4 * (a.shared_ops // 2), (a, b)
        assert b.binaries < 1.15 * a.binaries, (a, b)


def test_each_axis_solve_is_announced_while_it_runs() -> None:
    shown: list[str] = []

    @contextlib.contextmanager
    def status(message: str) -> Iterator[None]:
        shown.append(message)
        yield

    with torch.device("meta"):
        model = _MLP(64)
    g = capture(model, (torch.empty(8, 64), torch.empty(8, 64)))
    ctx = PassContext(Options(mesh=ir.Mesh.parse("a=2,b=2"), plan=Plan.of("auto")), status=status)
    parse_pipeline("cleanup,sharding").run(ctx, g)
    solves = [m.split(",")[0] for m in shown if m.startswith("sharding solve")]
    assert solves == ["sharding solve: mesh axis 'a'", "sharding solve: mesh axis 'b'"]
    assert [m for m in shown if m.startswith("pass ")] == ["pass 1 of 2: cleanup", "pass 2 of 2: sharding"]


_ONE_VALUE = """graph @g {
  input %x : f32[4096, 512]
  output out(0) = %x
}"""


@pytest.mark.parametrize("cluster", ["h100:8x1", "h100:2x4", None])
@pytest.mark.parametrize("axis", ["dp", "tp"])
@pytest.mark.parametrize(
    ("have", "want", "kind"),
    [
        (ir.Shard(0), ir.Replicate(), "all_gather"),
        (ir.Partial(), ir.Shard(0), "reduce_scatter"),
        (ir.Partial(), ir.Replicate(), "all_reduce"),
        (ir.Shard(0), ir.Shard(1), "all_to_all"),
    ],
)
def test_the_solve_prices_a_collective_as_the_cluster_simulator_does(
    cluster: str | None, axis: str, have: ir.Placement, want: ir.Placement, kind: str
) -> None:
    """One time model: the solve's optimum for a graph whose only cost is moving ``x`` from
    ``have`` to ``want`` on ``axis`` is the simulator's price of that collective on the group the
    axis's ranks form (ranks fill nodes with the last mesh axis innermost). Without a cluster the
    solve plans for gloo ranks on this CPU: the catalog's ``cpu`` device, one node."""
    graph = ir.parse(_ONE_VALUE)
    mesh = ir.Mesh.parse("dp=2,tp=4")
    x = graph.inputs[0].value
    problem = Problem(
        graph,
        mesh,
        candidates=[],
        start={x: Layout.on(mesh, **{axis: have})},
        free=frozenset(),
        wants={0: Layout.on(mesh, **{axis: want})},
        models=axis_models(mesh, parse_cluster(cluster) if cluster else None),
        valid=lambda op, s, earlier: True,
    )
    priced = {s.axis: s.objective for s in solve(problem).stats}

    sim_cluster = parse_cluster(cluster or "cpu:8x1")
    group = comm.place_axes(sim_cluster, [("tp", 4), ("dp", 2)], (axis,))
    full = 4096 * 512 * 4.0
    # NOTE: comm's all-to-all takes what one rank sends: its shard of the value
    sent = full / group.size if kind == "all_to_all" else full
    simulated = comm.collective_time(kind, sim_cluster, group, sent)
    assert simulated > 0
    assert priced[axis] == pytest.approx(simulated, rel=1e-9)
    assert all(t == 0 for a, t in priced.items() if a != axis), priced
