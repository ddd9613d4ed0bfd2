"""The pass contract: a frozen dataclass with a kebab-case ``name``, typed options and ``apply``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from meshfold.ir import Graph, Mesh

if TYPE_CHECKING:
    from meshfold.passes.cp import CpSpec
    from meshfold.passes.memory.policies import Saved
    from meshfold.passes.moe.spec import MoeSpec
    from meshfold.passes.sharding.plans import Plan
    from meshfold.target.hardware import Cluster

# NOTE: graph properties passes require and ensure. ``joint`` holds for a fresh capture.
JOINT = "joint"
CLEAN = "clean"
VERIFIED = "verified"


def quiet(message: str) -> AbstractContextManager[object]:
    """A ``PassContext.status`` that shows nothing."""
    return nullcontext()


class PassError(ValueError):
    """A pass cannot run: bad options, a pipeline in the wrong order, or a graph it cannot handle."""


class PassFailure(PassError):
    """A pass raised while running; names the pass and its position (the original error is the cause)."""

    def __init__(self, index: int, spelling: str, cause: Exception) -> None:
        super().__init__(f"pass {index + 1} ({spelling}) failed: {type(cause).__name__}: {cause}")
        self.index = index
        self.spelling = spelling


@dataclass
class PassContext:
    """Everything a pass may read besides the graph: what the compilation targets (set by the caller,
    read by passes, never reassigned by them) and what passes report back (diagnostics, stats).

    A fresh context per compilation; passes never keep state elsewhere.
    """

    mesh: Mesh | None = None
    plan: Plan | None = None
    """The plan the sharding pass follows (None: the preset the mesh's axis names imply)."""
    moe: MoeSpec | None = None
    """The expert mapping ``moe-fold`` applies and the sharding pass lays the expert weights out by."""
    cp: CpSpec | None = None
    """How attention reads a sequence split over the plan's ``cp`` axes (None: ``CpSpec()``)."""
    cluster: Cluster | None = None
    """The cluster the program is planned for (None: gloo ranks on this CPU)."""
    memory: int | None = None
    """Per-device memory bound in bytes for the sharding solve (None: the cluster's HBM, or none) and
    the budget the ``memory`` pass recomputes activations to meet (None: none)."""
    memory_policy: str | Callable[[Saved], str] | None = None
    """What the ``memory`` pass does when its pipeline options do not say (``"full"``, or a function
    answering ``"save"``, ``"recompute"`` or ``"offload"`` for each saved activation; None: keep
    what a budget allows)."""
    pipelined: bool = False
    """The program is split into pipeline stages at its layer stack after the passes
    (``meshfold.pp.stage_split``): ``bucket`` then never groups ops of the code before the stack with those after it."""
    diagnostics: list[str] = field(default_factory=list)
    stats: dict[str, object] = field(default_factory=dict)
    """Figures passes report about their own work (e.g. ``sharding.solve``: per-axis program size)."""
    status: Callable[[str], AbstractContextManager[object]] = quiet
    """Shows what a long step is doing while it runs (see ``meshfold.session.Progress``)."""

    def warn(self, message: str) -> None:
        """Record a diagnostic and surface it as a Python warning."""
        self.diagnostics.append(message)
        warnings.warn(message, stacklevel=3)


@dataclass(frozen=True)
class Pass:
    """Base of every pass. Subclasses are frozen dataclasses whose fields are the pass options.

    ``requires``: properties that must hold before the pass; ``ensures``: properties it establishes;
    ``invalidates``: properties that no longer hold after it (``"*"`` means all but ``ensures``).
    """

    name: ClassVar[str]
    requires: ClassVar[frozenset[str]] = frozenset()
    ensures: ClassVar[frozenset[str]] = frozenset()
    invalidates: ClassVar[frozenset[str]] = frozenset({"*"})

    def apply(self, ctx: PassContext, graph: Graph) -> Graph:
        """Return the rewritten graph; ``graph`` itself is never modified."""
        raise NotImplementedError

    def properties_after(self, before: frozenset[str]) -> frozenset[str]:
        kept = frozenset() if "*" in self.invalidates else before - self.invalidates
        return kept | self.ensures
