"""Each rank's forward program as an ONNX model, its collectives as ops of the ``meshfold`` domain.

``export_forward`` hands a rank's lowered forward module (``backends/eager.py``; made plain as for
Inductor, ``backends/traceable.py``) to ``torch.onnx.export``: the module's parameters and buffers
(this rank's shards) become initializers, its inputs are this rank's pieces of the model's tensor
inputs, its outputs are this rank's pieces of the model's outputs. Each functional collective
becomes one node of the ``meshfold`` domain, version 1, which a runtime executing the ranks'
models implements with its own communication library:

==========================  =====================================================================
``meshfold.AllReduce``      ``reduce`` ("sum", "max", "min", "avg"), ``ranks``: every rank of the
                            group gets the reduction of the group's inputs.
``meshfold.AllGather``      ``ranks``: the group's inputs concatenated along dim 0, in ``ranks``
                            order.
``meshfold.ReduceScatter``  ``reduce``, ``ranks``: the reduction of the group's inputs, cut in
                            ``len(ranks)`` equal blocks along dim 0; the i-th rank of ``ranks``
                            gets block i.
``meshfold.AllToAll``       ``ranks``, ``output_split_sizes``, ``input_split_sizes`` (rows along
                            dim 0, one count per rank of ``ranks``): block i of the input goes to
                            the i-th rank; the output is the blocks received, in ``ranks`` order.
==========================  =====================================================================

``ranks`` are global ranks (the ``torch.distributed`` world's). A collective is synchronous in
the ONNX graph: the start/wait split that lets it overlap with compute is not kept (``wait_tensor``
exports as ``Identity``). The model's metadata (``metadata_props``) records the rank, its mesh
coordinate, the mesh, and each input's and output's layout on it (``{dp: S(0)}`` and so on; an
input not named is replicated).

Not exported: a forward whose lowering calls process groups, files or meshfold's generator itself
(``traceable.REFUSED``, ring attention, pipeline sends) and the MoE token exchange between expert
ranks (the rows each rank receives are known only while it runs) are refused naming the op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from meshfold.backends.eager import Lowered
from meshfold.backends.traceable import EXCHANGE, plain

DOMAIN = "meshfold"
VERSION = 1

_CANNOT = "export_onnx cannot export"
_ADVICE = "Export a plan without it (its programs run only with backend='eager')"


def _ranks(group_name: str) -> list[int]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return list(dist.get_process_group_ranks(_resolve_process_group(group_name)))


_ATTRIBUTES: dict[str, tuple[tuple[str, str], ...]] = {
    "AllReduce": (("reduce", "STRING"), ("ranks", "INTS")),
    "AllGather": (("ranks", "INTS"),),
    "ReduceScatter": (("reduce", "STRING"), ("ranks", "INTS")),
    "AllToAll": (("ranks", "INTS"), ("output_split_sizes", "INTS"), ("input_split_sizes", "INTS")),
}
"""The ``meshfold`` domain's ops and their attributes (the module docstring says what each does)."""


def _register_domain() -> None:
    """Register the ``meshfold`` domain's schemas with onnx (once per process): the checker then
    checks each collective node's attributes, and onnxscript builds the nodes from them."""
    import onnx
    from onnx.defs import OpSchema

    types = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)", "tensor(int64)", "tensor(int32)"]
    for name, attributes in _ATTRIBUTES.items():
        if onnx.defs.has(name, DOMAIN):
            continue
        onnx.defs.register_schema(
            OpSchema(
                name,
                DOMAIN,
                VERSION,
                doc=f"meshfold collective {name} over the global ranks `ranks` (see meshfold.backends.onnx)",
                inputs=[OpSchema.FormalParameter("input", "T")],
                outputs=[OpSchema.FormalParameter("output", "T")],
                type_constraints=[("T", types, "the tensor types a collective moves")],
                attributes=[
                    OpSchema.Attribute(attr, getattr(OpSchema.AttrType, kind), f"{name}'s {attr}", required=True)
                    for attr, kind in attributes
                ],
            )
        )


def _translations() -> dict[Callable[..., Any], Callable[..., Any]]:
    """ONNX for each functional collective (the exporter traces these functions: plain Python)."""
    from onnxscript import opset18 as op
    from onnxscript import values

    _register_domain()
    mf = values.Opset(DOMAIN, VERSION)
    c10d = torch.ops._c10d_functional

    def all_reduce(x: Any, reduce_op: str, group_name: str) -> Any:
        return mf.AllReduce(x, reduce=reduce_op, ranks=_ranks(group_name))

    def all_gather(x: Any, group_size: int, group_name: str) -> Any:
        return mf.AllGather(x, ranks=_ranks(group_name))

    def reduce_scatter(x: Any, reduce_op: str, group_size: int, group_name: str) -> Any:
        return mf.ReduceScatter(x, reduce=reduce_op, ranks=_ranks(group_name))

    def all_to_all(x: Any, output_split_sizes: list[int], input_split_sizes: list[int], group_name: str) -> Any:
        return mf.AllToAll(
            x,
            ranks=_ranks(group_name),
            output_split_sizes=list(output_split_sizes),
            input_split_sizes=list(input_split_sizes),
        )

    def wait(x: Any) -> Any:
        return op.Identity(x)

    return {
        c10d.all_reduce.default: all_reduce,
        c10d.all_gather_into_tensor.default: all_gather,
        c10d.reduce_scatter_tensor.default: reduce_scatter,
        c10d.all_to_all_single.default: all_to_all,
        c10d.wait_tensor.default: wait,
    }


class _Forward(nn.Module):
    """A lowered forward module with this rank's state held: called with the model's tensor inputs
    (this rank's pieces), it returns the model's outputs (this rank's pieces) and nothing else."""

    def __init__(self, low: Lowered, state: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.program = plain(low.forward, _CANNOT, _ADVICE, exchange_op=False, refused=EXCHANGE)
        self.feeds: list[str | None] = []
        for name in low.fwd_inputs:
            if name in state:
                key = f"state_{len(self.feeds)}"
                self.register_buffer(key, state[name].detach().clone())
                self.feeds.append(key)
            else:
                self.feeds.append(None)
        self.outs = [i for i, (kind, _) in enumerate(low.fwd_outputs) if kind == "out"]

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        given = iter(inputs)
        results = self.program(*[next(given) if key is None else getattr(self, key) for key in self.feeds])
        return tuple(results[i] for i in self.outs)


def _export(
    module: nn.Module, inputs: Sequence[torch.Tensor], input_names: Sequence[str], output_names: Sequence[str]
) -> Any:
    with torch.no_grad():
        exported = torch.onnx.export(
            module,
            tuple(inputs),
            dynamo=True,
            input_names=list(input_names),
            output_names=list(output_names),
            custom_translation_table=_translations(),
            verbose=False,
        )
    assert exported is not None
    return exported


def export_forward(
    low: Lowered,
    state: Mapping[str, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    path: Path,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    metadata: Mapping[str, str],
) -> Path:
    """Write ``low``'s forward as the ONNX model ``path``: ``state`` the values of its parameters and
    buffers on this rank (by graph input name), ``inputs`` this rank's pieces of the model's tensor
    inputs (as the forward module takes them), ``metadata`` added to the model's ``metadata_props``.
    The file is written whole or not at all (a temporary name, then renamed)."""
    import onnx

    module = _Forward(low, state)
    # NOTE: the exporter warns, on every rank, for each torchvision op it has no torchvision for
    quiet = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        exported = _export(module, inputs, input_names, output_names)
    finally:
        quiet.setLevel(level)
    model = exported.model_proto
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    if all(o.domain != DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, VERSION))
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    onnx.save_model(model, partial)
    partial.replace(path)
    return path


def reference_ops(groups: Sequence[dist.ProcessGroup]) -> list[type]:
    """The ``meshfold`` domain's ops for ``onnx.reference.ReferenceEvaluator(model, new_ops=...)``,
    each run by ``torch.distributed``'s functional collectives on the group of ``groups`` whose
    global ranks are its ``ranks`` (a mesh's ``get_all_groups()`` on this rank): the domain's
    semantics in runnable form, so every rank's exported model can be run together and compared
    with the compiled program."""
    import torch.distributed._functional_collectives as funcol
    from onnx.reference.op_run import OpRun

    by_ranks = {tuple(dist.get_process_group_ranks(g)): g for g in groups}

    def group(ranks: Sequence[int]) -> dist.ProcessGroup:
        try:
            return by_ranks[tuple(ranks)]
        except KeyError:
            raise ValueError(f"no process group of ranks {list(ranks)} among {sorted(by_ranks)}") from None

    def run(fn: Callable[..., torch.Tensor]) -> Callable[..., tuple[Any]]:
        def _run(self: OpRun, x: Any, **attributes: Any) -> tuple[Any]:
            return (fn(torch.from_numpy(x.copy()), **attributes).numpy(),)

        return _run

    def all_reduce(x: torch.Tensor, reduce: str, ranks: Sequence[int]) -> torch.Tensor:
        return funcol.all_reduce(x, reduce, group(ranks)).wait()

    def all_gather(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
        return funcol.all_gather_tensor(x, 0, group(ranks)).wait()

    def reduce_scatter(x: torch.Tensor, reduce: str, ranks: Sequence[int]) -> torch.Tensor:
        return funcol.reduce_scatter_tensor(x, reduce, 0, group(ranks)).wait()

    def all_to_all(
        x: torch.Tensor, ranks: Sequence[int], output_split_sizes: Sequence[int], input_split_sizes: Sequence[int]
    ) -> torch.Tensor:
        return funcol.all_to_all_single(x, list(output_split_sizes), list(input_split_sizes), group(ranks)).wait()

    kernels = {
        "AllReduce": all_reduce,
        "AllGather": all_gather,
        "ReduceScatter": reduce_scatter,
        "AllToAll": all_to_all,
    }
    return [type(name, (OpRun,), {"op_domain": DOMAIN, "_run": run(fn)}) for name, fn in kernels.items()]
