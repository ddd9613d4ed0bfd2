"""``PassContext``: what a pass may read besides the graph, and what it reports back."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from meshfold.ir import Mesh
from meshfold.passes.base import quiet
from meshfold.passes.options import Options


@dataclass
class PassContext:
    """One compilation's ``options`` (read by passes, never reassigned by them), the ``mesh`` the
    graph is laid out on (the options', or the one an IR file declares), and what passes report back
    for people to read: ``diagnostics`` and ``stats``. A pass never reads another pass's ``stats``:
    what one pass establishes for a later one is in the graph or a declared property
    (``Pass.requires`` / ``Pass.ensures``).

    A fresh context per compilation; passes never keep state elsewhere.
    """

    options: Options = field(default_factory=Options)
    mesh: Mesh | None = None
    diagnostics: list[str] = field(default_factory=list)
    stats: dict[str, object] = field(default_factory=dict)
    """Figures passes report about their own work (e.g. ``sharding.solve``: per-axis program size)."""
    status: Callable[[str], AbstractContextManager[object]] = quiet
    """Shows what a long step is doing while it runs (see ``meshfold.session.progress``)."""

    def __post_init__(self) -> None:
        if self.mesh is None:
            self.mesh = self.options.mesh

    def warn(self, message: str) -> None:
        """Record a diagnostic and surface it as a Python warning."""
        self.diagnostics.append(message)
        warnings.warn(message, stacklevel=3)
