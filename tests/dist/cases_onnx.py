"""Tasks for the ONNX export's rank tests: each rank's exported forward run beside its compiled program."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshfold.api import parallelize
from meshfold.passes import PassError
from meshfold.tools.pool_worker import device_mesh
from meshfold.tools.zoo import build
from tests.dist.captures import shared_capture


def exported_forward(model: str, plan: str, shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, Any]:
    """Compile ``model`` for the mesh, export this rank's forward, run the file with onnx's reference
    evaluator (the ``meshfold`` domain's collectives over the mesh's gloo groups, the ranks together)
    and return how far its output lies from the compiled program's and the single-device model's."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    from meshfold.backends.onnx import DOMAIN, reference_ops

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    net, inputs = build(model)
    with torch.no_grad():
        reference = net(*inputs)
    mesh = device_mesh(shape, names)
    with shared_capture(f"zoo:{model}"):
        pm = parallelize(net, mesh, inputs, plan=plan)
    with torch.no_grad():
        out = pm(*inputs)
        compiled = (out.to_local() if isinstance(out, DTensor) else out).detach()
    with tempfile.TemporaryDirectory() as tmp:
        path = pm.export_onnx(tmp)
        proto = onnx.load(str(path))
        files = sorted(p.name for p in Path(tmp).iterdir())
    meta = {p.key: p.value for p in proto.metadata_props}
    feeds = {}
    for i in proto.graph.input:
        layout = meta[f"{DOMAIN}.layout.{i.name}"]
        x = inputs[[n.name for n in proto.graph.input].index(i.name)]
        feeds[i.name] = _piece(x, layout, mesh).numpy()
    evaluator = ReferenceEvaluator(proto, new_ops=reference_ops(mesh.get_all_groups()))
    (got,) = evaluator.run(None, feeds)
    got = torch.from_numpy(got)
    return {
        "path": path.name,
        "files": files,
        "collectives": sorted({n.op_type for n in proto.graph.node if n.domain == DOMAIN}),
        "output_layout": meta[f"{DOMAIN}.layout.output0"],
        "vs_compiled": float((got - compiled).abs().max()),
        "vs_model": float((got - reference).abs().max()),
    }


def _piece(x: torch.Tensor, layout: str, mesh: Any) -> torch.Tensor:
    """This rank's piece of ``x`` for a layout as the exported metadata writes it (``{dp: S(0)}``)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements: list[Any] = [Replicate() for _ in mesh.mesh_dim_names]
    for part in filter(None, layout.strip("{}").split(", ")):
        axis, placement = part.split(": ")
        assert placement.startswith("S("), placement
        placements[mesh.mesh_dim_names.index(axis)] = Shard(int(placement[2:-1]))
    return distribute_tensor(x, mesh, placements, src_data_rank=None).to_local()


def export_refused() -> str:
    """Export an MoE model whose experts are split over the ranks (EP); return the error."""
    warnings.filterwarnings("ignore")
    net, inputs = build("mixtral-tiny")
    pm = parallelize(net, device_mesh((2, 2), ("dp", "tp")), inputs, plan="fsdp+tp", moe={"ep": 4})
    with tempfile.TemporaryDirectory() as tmp:
        try:
            pm.export_onnx(tmp)
        except PassError as e:
            assert not any(Path(tmp).iterdir()), "a refused export left a file behind"
            return str(e)
    raise AssertionError("export_onnx exported the token exchange between expert ranks")


def world_one_onnxruntime(model: str) -> dict[str, Any]:
    """On a world of one rank: export ``model``'s forward and run it in onnxruntime; return how far
    its output lies from the single-device model's and which domains its nodes use."""
    import onnx
    import onnxruntime

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    net, inputs = build(model)
    with torch.no_grad():
        reference = net(*inputs)
    pm = parallelize(net, device_mesh((1,), ("dp",)), inputs)
    with tempfile.TemporaryDirectory() as tmp:
        path = pm.export_onnx(tmp)
        domains = sorted({n.domain or "ai.onnx" for n in onnx.load(str(path)).graph.node})
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    (got,) = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), tensors, strict=True)})
    return {"domains": domains, "diff": float((torch.from_numpy(got) - reference).abs().max())}
