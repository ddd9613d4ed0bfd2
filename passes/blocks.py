"""Repeated blocks: ops and parameters of ``layers.3`` that mirror those of ``layers.0``.

A block is a module path up to its first numeric component (``layers.3.mlp.up_proj`` is in block
``layers.3`` of family ``layers``). Passes use this to treat a stack of identical layers once: the
sharding solve shares one set of strategy variables across them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from meshfold.ir import Graph, Op


def block_of(path: str) -> str:
    """``layers.3.mlp.up_proj`` → ``layers.3``; a path without an index → ``""`` (the root)."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _family(block: str) -> str:
    return block.rsplit(".", 1)[0]


def _block_ops(graph: Graph) -> dict[str, list[int]]:
    blocks: dict[str, list[int]] = defaultdict(list)
    for i, op in enumerate(graph.ops):
        b = block_of(op.prov.module)
        if b:
            blocks[b].append(i)
    return blocks


def mirrored_blocks(graph: Graph, same: Callable[[Op, Op], bool]) -> dict[str, str]:
    """Block → the earlier block of its family it mirrors: whose ops (in program order, both
    phases) pair up one to one with its own under ``same``. A block that mirrors none is absent
    (and may itself be mirrored: the first layer often differs, as its input needs no gradient)."""
    blocks = _block_ops(graph)
    reps: dict[str, list[str]] = defaultdict(list)
    out: dict[str, str] = {}
    for b, members in blocks.items():
        family = reps[_family(b)]
        for r in family:
            rep = blocks[r]
            if len(rep) == len(members) and all(
                same(graph.ops[i], graph.ops[j]) for i, j in zip(members, rep, strict=True)
            ):
                out[b] = r
                break
        else:
            family.append(b)
    return out


def mirrored_ops(graph: Graph, same: Callable[[Op, Op], bool]) -> dict[int, int]:
    """Op index → index of the op it mirrors (see ``mirrored_blocks``)."""
    blocks = _block_ops(graph)
    out: dict[int, int] = {}
    for b, r in mirrored_blocks(graph, same).items():
        out.update(zip(blocks[b], blocks[r], strict=True))
    return out


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
