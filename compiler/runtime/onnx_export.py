"""``ParallelModule.export_onnx``: this rank's forward program written as an ONNX model
(``backends/onnx.py`` says what the file holds)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_leaves

from meshfold.backends.onnx import DOMAIN
from meshfold.backends.select import get_onnx

if TYPE_CHECKING:
    from meshfold.runtime.parallel_module import ParallelModule


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def export_onnx(pm: ParallelModule, directory: str | os.PathLike[str]) -> Path:
    """Write the forward of ``pm``'s program for its example inputs, as this rank runs it, to
    ``directory/rank{R}.onnx`` (R: this rank in the world) and return the path."""
    program = pm._mf_programs.first
    graph, low = program.graph, program.lowered
    mesh = graph.mesh
    coordinate = tuple(pm._mf_mesh.get_coordinate() or ())
    values = {i.name: i.value for i in graph.inputs}
    state, inputs, input_names = {}, [], []
    for name in low.fwd_inputs:
        if program.kinds[name] in ("param", "buffer"):
            state[name] = _local(pm._mf_tensor(name))
            continue
        v = values[name]
        if not v.type.is_static():
            raise ValueError(
                f"export_onnx: input {name!r} has the symbolic shape {v.type}; ONNX files are written for "
                "programs of static shapes only"
            )
        local = v.layout.local_shape(v.type.shape, mesh, coordinate) if mesh is not None else v.type.shape
        inputs.append(torch.zeros(local, dtype=v.type.dtype))
        input_names.append(name)
    outputs = {o.name: o.value for o in graph.outputs if o.kind == "out"}
    output_names = [f"output{name}" for kind, name in low.fwd_outputs if kind == "out"]
    metadata = {
        f"{DOMAIN}.rank": str(dist.get_rank()),
        f"{DOMAIN}.mesh": str(mesh),
        f"{DOMAIN}.coordinate": ",".join(map(str, coordinate)),
    }
    for name in input_names:
        metadata[f"{DOMAIN}.layout.{name}"] = str(values[name].layout)
    for name in output_names:
        metadata[f"{DOMAIN}.layout.{name}"] = str(outputs[name.removeprefix("output")].layout)
    path = Path(directory) / f"rank{dist.get_rank()}.onnx"
    return get_onnx().export(
        low, state, inputs, path, input_names=input_names, output_names=output_names, metadata=metadata
    )


def check_onnx(pm: ParallelModule, path: Path, inputs: tuple[Any, ...]) -> float:
    """Run the file ``export_onnx`` wrote on this rank with onnx's reference evaluator (its
    collectives over the mesh's groups: every rank calls this together) on this rank's pieces of
    ``inputs``, the example inputs; return the largest difference from ``pm``'s own outputs there."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    from meshfold.backends.onnx import reference_ops
    from meshfold.runtime.groups import dtensor_placements

    program = pm._mf_programs.first
    layouts = {i.name: i.value.layout for i in program.graph.inputs}
    user = iter(x for x in inputs if isinstance(x, torch.Tensor))
    pieces = [
        distribute_tensor(next(user), pm._mf_mesh, dtensor_placements(layouts[n]), src_data_rank=None).to_local()
        for n in program.lowered.fwd_inputs
        if program.kinds[n] not in ("param", "buffer")
    ]
    proto = onnx.load(str(path))
    evaluator = ReferenceEvaluator(proto, new_ops=reference_ops(pm._mf_mesh.get_all_groups()))
    got = evaluator.run(None, {i.name: x.numpy() for i, x in zip(proto.graph.input, pieces, strict=True)})
    with torch.no_grad():
        out = pm(*inputs)
    flat = tree_leaves(out)
    if program.structure is not None:
        # NOTE: graph output ``out(i)`` is the model's tensor leaf i (``ParallelModule._mf_assemble``)
        flat = [flat[int(name)] for kind, name in program.lowered.fwd_outputs if kind == "out"]
    expected = [_local(t) for t in flat]
    return max(float((torch.from_numpy(g) - e).abs().max()) for g, e in zip(got, expected, strict=True))
