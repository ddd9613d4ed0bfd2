"""Random op chains x random parameter layouts, executed on 4 gloo ranks ((2, 2) mesh ``dp`` x ``tp``).

Each example (:func:`tests.property.chain_gen.chains`) is a chain of >= 3 ops from the rule table
over 2-4 params, each param placed ``R``, ``S(d)`` or ``P`` per mesh axis by a user plan. The
``sharding`` and ``boxing`` passes must give a verified graph without ``comm.redistribute``, and
every rank's lowered program, fed its piece of seeded global inputs, must reproduce the reference
interpreter on the unsharded graph:

- forward: ``out(0)`` (Replicate by construction) of the chain itself;
- joint: ``out(0)`` and every gradient of the chain captured as a module (forward + backward),
  combined from the ranks by each output's layout.

Examples are drawn by hypothesis (derandomized), checked in batches on the ranks, and a failing
example is then replayed through hypothesis so that it shrinks to a small report.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from meshfold import Options, compile_model, ir
from meshfold.ir.ops import REDISTRIBUTE
from meshfold.passes.sharding.plans import Plan
from meshfold.tools.pool import RankPool
from tests.property.chain_cases import combine, local_pieces
from tests.property.chain_gen import chains
from tests.property.chain_ir import Chain, joint_text

pytestmark = pytest.mark.dist

MESH = ir.Mesh.of(dp=2, tp=2)
FORWARD_EXAMPLES = 240
JOINT_EXAMPLES = 32
BATCH = 60
SHRINK_BUDGET_S = 120.0
# NOTE: derandomized, so CI checks the same examples every run; no example database either.
SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

Key = tuple[str, str, int]
Job = tuple[str, str, int]


class ChainFailure(AssertionError):
    """One chain that failed: its text, layouts and what went wrong."""


@dataclass(frozen=True)
class Kind:
    """One property: how to turn a chain into a graph, the passes to run, and the rank task."""

    name: str
    graph_text: Callable[[Chain], str]
    pipeline: str
    task: str


FORWARD = Kind("forward", lambda c: c.text, "sharding,boxing", "tests.property.chain_cases:run_chains")
JOINT = Kind("joint", joint_text, "cleanup,sharding,boxing", "tests.property.chain_cases:run_joints")


def _key(chain: Chain) -> Key:
    return chain.text, repr(sorted(chain.layouts.items())), chain.seed


def prepare(kind: Kind, chain: Chain) -> Job:
    """The job the ranks run for ``chain``: (graph text, boxed graph text, seed). Raises when a pass
    fails or the boxed graph does not verify or still redistributes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = kind.graph_text(chain)
        graph = ir.parse(text)
        # NOTE: a param the chain never uses is not an input of its captured graph.
        names = {i.name for i in graph.inputs}
        plan = Plan.of("ddp+tp", {n: axes for n, axes in chain.layouts.items() if n in names})
        boxed = compile_model(graph, None, Options.of(mesh=MESH, plan=plan, pipeline=kind.pipeline)).graph
    ir.verify(boxed, check_types=False)
    left = [op.describe() for op in boxed.ops if op.target == REDISTRIBUTE]
    assert not left, f"boxing left comm.redistribute ops: {left}"
    return text, str(boxed), chain.seed


def _report(kind: Kind, chain: Chain, error: str, boxed: str | None = None) -> str:
    """The chain, its layouts and seed, the graph the ranks ran (when it was built) and the error."""
    ran = f"// the boxed graph the ranks lowered:\n{boxed}" if boxed else ""
    return f"{kind.name} chain failed on 4 ranks:\n{chain}{ran}{error.rstrip()}\n"


class ChainProperty:
    """Checks one :class:`Kind` over ``n`` distinct hypothesis examples, ``BATCH`` per pool task."""

    def __init__(self, kind: Kind, pool: RankPool, n: int) -> None:
        self.kind, self.pool, self.n = kind, pool, n
        self.known: dict[Key, str | None] = {}
        self.boxed: dict[Key, str] = {}

    def _explore(self, body: Callable[[Chain], None], phases: tuple[Phase, ...]) -> None:
        # NOTE: the same function (hence the same derandomized seed) for collecting and replaying, so
        # a replay meets the examples in the order the collection did.
        @settings(SETTINGS, max_examples=self.n + self.n // 4, phases=phases)
        @given(chains())
        def chain_property(chain: Chain) -> None:
            body(chain)

        chain_property()

    def _run(self, jobs: list[Job]) -> list[str | None]:
        per_rank = self.pool.run(self.kind.task, examples=jobs)
        # NOTE: every rank of run_chains reports the failures of all; run_joints answers on rank 0 only.
        return list(per_rank[0])

    def check(self) -> int:
        """Run the property; raise with a report (shrunk where hypothesis can) on any failure.
        Returns how many examples ran on the ranks."""
        drawn: dict[Key, Chain] = {}

        def collect(chain: Chain) -> None:
            if len(drawn) < self.n:
                drawn.setdefault(_key(chain), chain)

        self._explore(collect, (Phase.generate,))
        examples = list(drawn.values())
        jobs: list[tuple[Chain, Job]] = []
        for chain in examples:
            try:
                jobs.append((chain, prepare(self.kind, chain)))
                self.boxed[_key(chain)] = jobs[-1][1][1]
            except Exception as e:
                self.known[_key(chain)] = f"preparing it failed: {type(e).__name__}: {e}"
        for start in range(0, len(jobs), BATCH):
            batch = jobs[start : start + BATCH]
            for (chain, _), error in zip(batch, self._run([j for _, j in batch]), strict=True):
                self.known[_key(chain)] = error
        failed = [c for c in examples if self.known.get(_key(c))]
        if failed:
            key = _key(failed[0])
            first = _report(self.kind, failed[0], self.known[key] or "", self.boxed.get(key))
            raise ChainFailure(
                f"{len(failed)} of {len(examples)} {self.kind.name} chains failed.\n"
                f"Smallest reproduction hypothesis found:\n{self._shrink()}\nFirst failure as drawn:\n{first}"
            )
        return len(examples)

    def _shrink(self) -> str:
        """Replay the examples through hypothesis (known verdicts are not rerun) so that it shrinks
        the first failure, running new candidates one by one for at most ``SHRINK_BUDGET_S``."""
        deadline = time.monotonic() + SHRINK_BUDGET_S

        def replay(chain: Chain) -> None:
            key = _key(chain)
            if key not in self.known:
                if time.monotonic() > deadline:
                    return
                try:
                    job = prepare(self.kind, chain)
                    self.boxed[key] = job[1]
                    self.known[key] = self._run([job])[0]
                except Exception as e:
                    self.known[key] = f"{type(e).__name__}: {e}"
            error = self.known[key]
            if error:
                raise ChainFailure(_report(self.kind, chain, error, self.boxed.get(key)))

        try:
            self._explore(replay, (Phase.generate, Phase.shrink))
        except ChainFailure as e:
            return str(e)
        return "(the replay did not meet the failure again; see the first failure below)"


def run_one(kind: Kind, pool: RankPool, chain: Chain) -> str | None:
    """Run one explicit chain on the ranks: None when it passes, else the report."""
    (error,) = pool.run(kind.task, examples=[prepare(kind, chain)])[0]
    return None if error is None else _report(kind, chain, error)


@pytest.mark.parametrize("dp", ["R", "S(0)", "S(1)", "P"])
@pytest.mark.parametrize("tp", ["R", "S(0)", "S(1)", "P"])
def test_local_pieces_combine_back(dp: str, tp: str) -> None:
    """The ranks' inputs represent the global value: ``combine(local_pieces(x))`` is ``x``, and ranks
    of a Replicate group hold equal pieces (checked by ``combine``)."""
    layout = ir.Layout(MESH.names, (ir.parse_placement(dp), ir.parse_placement(tp)))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    pieces = local_pieces(x, layout, MESH, seed=1)
    torch.testing.assert_close(combine(pieces, layout, MESH), x)


def test_forward_chains_match_the_interpreter_on_ranks(chain_pool: RankPool) -> None:
    """>= 200 random forward chains: every rank's out(0) equals the interpreter's."""
    ran = ChainProperty(FORWARD, chain_pool, FORWARD_EXAMPLES).check()
    assert ran >= 200, f"only {ran} distinct examples were drawn"


def test_joint_chains_match_the_interpreter_on_ranks(chain_pool: RankPool) -> None:
    """Random chains captured with their backward: out(0) and every gradient, combined from the ranks
    by their layouts, equal the interpreter's on the unsharded joint graph."""
    ran = ChainProperty(JOINT, chain_pool, JOINT_EXAMPLES).check()
    assert ran >= JOINT_EXAMPLES * 3 // 4, f"only {ran} distinct examples were drawn"


STACK_MAXIMUM = """graph @chain mesh<dp=2, tp=2> {
  param %p0 : f32[4]
  param %p1 : f32[4]
  param %p2 : f32[]
  %v1 = aten.stack([%p0, %p1], 0) : f32[2, 4]
  %v2 = aten.maximum(%v1, %p2) : f32[2, 4]
  output out(0) = %v2
}
"""


def test_joint_stack_then_maximum(chain_pool: RankPool) -> None:
    """Found by the joint property: the select.int ops of stack's backward carry no autograd metadata,
    and capture used to tag them forward, so lowering met a forward op using a backward value."""
    layouts = {"p0": {"dp": "S(0)", "tp": "R"}, "p1": {"dp": "R", "tp": "P"}, "p2": {"dp": "P", "tp": "R"}}
    error = run_one(JOINT, chain_pool, Chain(STACK_MAXIMUM, layouts, 0))
    assert error is None, error
