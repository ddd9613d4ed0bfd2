"""The process groups a module's programs run their collectives on.

Without a timeout these are the ``DeviceMesh``'s own (each waits as long as the process group was
created to). ``parallelize(..., timeout=)`` makes groups of the same ranks whose collectives give
up after that long, so a stuck rank surfaces on the others as an error naming the collective, the
op and the mesh axis (``backends/watch.py``) instead of a wait of gloo's default 30 minutes; the
per-call check runs on such a group over the whole world.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from meshfold import ir
from meshfold.backends.eager import RankContext, exchange_axes


@dataclass
class MeshGroups:
    """Group names per mesh axis, the world group of the call check, and groups over several axes
    made on demand. Creating groups is collective: every rank makes the same ones in one order."""

    mesh: DeviceMesh
    timeout: timedelta | None
    world: dist.ProcessGroup
    axes: tuple[str, ...]
    _flat: dict[tuple[str, ...], str] = field(default_factory=dict)

    @staticmethod
    def of(mesh: DeviceMesh, timeout: timedelta | None) -> MeshGroups:
        if timeout is None:
            axes = tuple(mesh.get_group(i).group_name for i in range(mesh.ndim))
            return MeshGroups(mesh, None, dist.group.WORLD, axes)  # type: ignore[arg-type]
        names = mesh.mesh_dim_names or ()
        axes = tuple(_timed(mesh, (names[i],), timeout).group_name for i in range(mesh.ndim))
        world, _ = dist.new_subgroups_by_enumeration([list(range(dist.get_world_size()))], timeout=timeout)
        assert world is not None
        return MeshGroups(mesh, timeout, world, axes)

    def over(self, axes: tuple[str, ...]) -> str:
        """The group spanning mesh axes ``axes`` (in mesh order), ranks numbered row-major."""
        if axes not in self._flat:
            if self.timeout is None:
                self._flat[axes] = self.mesh[axes]._flatten().get_group().group_name
            else:
                self._flat[axes] = _timed(self.mesh, axes, self.timeout).group_name
        return self._flat[axes]

    def rank_context(self, mesh: ir.Mesh, graph: ir.Graph) -> RankContext:
        """What lowering ``graph`` needs of this rank (collective where it needs new groups)."""
        coordinate = self.mesh.get_coordinate()
        assert coordinate is not None, "this rank is not in the mesh"
        flat = tuple((axes, self.over(axes)) for axes in exchange_axes(graph))
        return RankContext(mesh, tuple(coordinate), self.axes, flat, gloo=self.mesh.device_type == "cpu")


def _timed(mesh: DeviceMesh, axes: Sequence[str], timeout: timedelta) -> dist.ProcessGroup:
    """This rank's group over mesh ``axes`` among groups of the same ranks that time out."""
    names = list(mesh.mesh_dim_names or ())
    dims = [names.index(a) for a in axes]
    ranks = mesh.mesh.movedim(dims, list(range(mesh.ndim - len(dims), mesh.ndim)))
    rows = ranks.reshape(-1, ranks[(0,) * (mesh.ndim - len(dims))].numel()).tolist()
    mine, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout)
    assert mine is not None
    return mine


def dtensor_placements(layout: ir.Layout) -> list[Any]:
    """Our placements as DTensor's (same order: one per mesh dim)."""
    out: list[Any] = []
    for p in layout.placements:
        if isinstance(p, ir.Shard):
            out.append(Shard(p.dim))
        elif isinstance(p, ir.Partial):
            out.append(Partial(p.reduce))
        else:
            out.append(Replicate())
    return out
