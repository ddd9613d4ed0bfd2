"""Repeated blocks: ops and parameters of ``layers.3`` that mirror those of ``layers.0``.

A block is a module path up to its first numeric component (``layers.3.mlp.up_proj`` is in block
``layers.3`` of family ``layers``). Two blocks of a family mirror each other when their ops, in
program order and over both phases, match one for one: the same target, operand and result types,
and the same arguments besides the values they read (which values, and so which parameters and
names, may differ). Two things capture and cleanup do are seen through: a backward op capture
attributes to no module (a sum of gradients) belongs to the block of its latest operand, and ops
of the first block that later blocks read instead of repeating (common-subexpression elimination
keeps one view of the rotary tables, of the attention mask) are left out of the match. A family
may hold several kinds (a dense first layer, then MoE layers; linear
and softmax attention in turn): each block mirrors the first block of its kind. Passes use this to
treat a stack of identical layers once: the sharding solve shares one set of strategy variables
across them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from functools import lru_cache

from meshfold.ir import Graph, Value


@lru_cache(maxsize=1 << 16)
def block_of(path: str) -> str:
    """``layers.3.mlp.up_proj`` → ``layers.3``; a path without an index → ``""`` (the root). Kept:
    every op of a module asks, in each pass that groups ops by block."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _family(block: str) -> str:
    return block.rsplit(".", 1)[0]


def op_kinds(graph: Graph) -> list[int]:
    """Each op's ``Op.key`` as a small integer, equal where the keys are (cheap to hash and compare):
    two mirroring ops share it."""
    ids: dict[Hashable, int] = {}
    return [ids.setdefault(op.key(), len(ids)) for op in graph.ops]


def op_blocks(graph: Graph) -> list[str]:
    """Each op's block (``""``: none). A backward op capture attributes to no module (the sum of a
    value's gradients from its several uses, such as the residual stream's; a gradient's layout
    change on its way out) belongs to the block of its latest operand."""
    out: list[str] = []
    owner: dict[Value, tuple[int, str]] = {}
    for i, op in enumerate(graph.ops):
        b = block_of(op.prov.module)
        if not op.prov.module and op.prov.phase == "bwd":
            b = max((owner[v] for v in op.operands if v in owner), default=(-1, ""))[1]
        for r in op.results:
            if b:
                owner[r] = (i, b)
        out.append(b)
    return out


def block_ops(graph: Graph) -> dict[str, list[int]]:
    """Each block's ops in program order (``op_blocks``)."""
    blocks: dict[str, list[int]] = defaultdict(list)
    for i, b in enumerate(op_blocks(graph)):
        if b:
            blocks[b].append(i)
    return blocks


class _Rep:
    """What ``_hoisted`` needs of a first block ``rep`` (the same for every block matched to it):
    its ops, which op makes each of their results, and which of them are computed from nothing of
    ``rep``'s own (no parameter under ``rep``, no value of another ``rep`` op that is not itself so)."""

    def __init__(self, graph: Graph, rep: list[int], prefix: str) -> None:
        own_inputs = {i.value for i in graph.inputs if i.name.startswith(prefix + ".")}
        self.ops = rep
        self.made_by = {r: i for i in rep for r in graph.ops[i].results}
        self.invariant: set[int] = set()
        for i in rep:
            if all(
                v not in own_inputs and (v not in self.made_by or self.made_by[v] in self.invariant)
                for v in graph.ops[i].operands
            ):
                self.invariant.add(i)


def _hoisted(graph: Graph, rep: _Rep, block: list[int]) -> set[int]:
    """Ops of ``rep`` that ``block`` shares rather than repeats: invariant (``_Rep``) and read by
    ``block`` (or by such ops that are). Common-subexpression elimination keeps a layer's view of
    the rotary tables or of the attention mask in the first layer only: the later layers read the
    first layer's."""
    made_by = rep.made_by
    read = {made_by[v] for j in block for v in graph.ops[j].operands if v in made_by}
    shared: set[int] = set()
    for i in reversed(rep.ops):
        if i in rep.invariant and (
            i in read or any(made_by.get(v) == i for j in shared for v in graph.ops[j].operands)
        ):
            shared.add(i)
    return shared


def _mirror(graph: Graph, keys: Sequence[int], rep: _Rep, block: list[int]) -> dict[int, int] | None:
    """``block``'s ops → the ``rep`` ops they repeat, one for one and in order; None if they do not."""
    shared = _hoisted(graph, rep, block)
    repeated = [i for i in rep.ops if i not in shared]
    if len(repeated) != len(block) or any(keys[i] != keys[j] for i, j in zip(block, repeated, strict=True)):
        return None
    return dict(zip(block, repeated, strict=True))


def mirrors(graph: Graph, keys: Sequence[int] | None = None) -> tuple[dict[str, str], dict[int, int]]:
    """``mirrored_blocks`` and ``mirrored_ops`` at once; ``keys``: ``op_kinds(graph)`` where the
    caller has it."""
    keys = op_kinds(graph) if keys is None else keys
    blocks = block_ops(graph)
    kinds: dict[str, list[str]] = defaultdict(list)
    reps: dict[str, _Rep] = {}
    out: dict[str, str] = {}
    ops: dict[int, int] = {}
    for b, members in blocks.items():
        family = kinds[_family(b)]
        for r in family:
            if r not in reps:
                reps[r] = _Rep(graph, blocks[r], r)
            pairs = _mirror(graph, keys, reps[r], members)
            if pairs is not None:
                out[b] = r
                ops.update(pairs)
                break
        else:
            family.append(b)
    return out, ops


def mirrored_blocks(graph: Graph) -> dict[str, str]:
    """Block → the earlier block of its family and kind it mirrors. The first block of each kind is
    absent (it mirrors none)."""
    return mirrors(graph)[0]


def mirrored_ops(graph: Graph) -> dict[int, int]:
    """Op index → index of the op it mirrors (see ``mirrored_blocks``)."""
    return mirrors(graph)[1]


def mirrored_inputs(graph: Graph, blocks: dict[str, str]) -> dict[str, str]:
    """Input FQN → the FQN that plays its role in the block its own block mirrors (``layers.3.mlp.w``
    → ``layers.1.mlp.w``), where that input exists."""
    names = {i.name for i in graph.inputs}
    out: dict[str, str] = {}
    for i in graph.inputs:
        b = block_of(i.name)
        if b in blocks and blocks[b] + i.name[len(b) :] in names:
            out[i.name] = blocks[b] + i.name[len(b) :]
    return out
