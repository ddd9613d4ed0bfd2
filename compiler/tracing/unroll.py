"""Stamping the layers a reduced capture left out back into its joint graph (see ``meshfold.tracing.layer_runs``).

A run ``first..last`` was captured as layers ``first`` (the template ``t``) and ``last`` (``l``), with
``first - 1`` before them; the graph has ``t``'s forward and backward ops, and ``l``'s, one for one.
Laying ``t``'s ops beside ``l``'s says what each value ``t`` reads is:

- its own (made by an earlier op of ``t``);
- one of its parameters (``l`` reads its own of the same relative name);
- shared (``l`` reads the very same value: the rotary tables, the mask);
- the forward chain: ``t`` reads a value of the layer before it where ``l`` reads one of ``t``'s (the
  hidden states, in the forward and as saved by the backward);
- the backward chain: ``t`` reads a value of ``l``'s backward where ``l`` reads one of the code after
  the run (the gradient of the layer's output).

Copy ``j`` of ``t`` (``first < j < last``) reads its own parameters, copy ``j - 1``'s forward chain
and copy ``j + 1``'s backward chain. The copies' forward ops follow ``t``'s forward, their backward
ops (last copy first) precede ``t``'s backward; ``l`` then reads the last copy instead of ``t``, and
``t`` the first copy's backward instead of ``l``'s. Each copy's parameters become inputs and their
gradients outputs beside ``t``'s, named by the copy's own FQNs. Where the two layers do not line up
so, ``Unfoldable`` says why and the caller captures the whole model instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshfold.ir import Graph, GraphInput, GraphOutput, Op, ParamStack, Provenance, Value
from meshfold.ir.graph import Arg, map_values, remap_op
from meshfold.passes.blocks import block_ops, op_kinds
from meshfold.tracing.layer_runs import Run


class Unfoldable(Exception):
    """The captured template and last layer of a run do not line up (the message says where)."""


def unroll(graph: Graph, runs: Sequence[Run]) -> Graph:
    """``graph`` with every run's left-out layers stamped back."""
    for run in runs:
        graph = _Stamp(graph, run).graph()
    return graph


def _rename(name: str, old: str, new: str) -> str | None:
    if name == old:
        return new
    if name.startswith(old + "."):
        return new + name[len(old) :]
    return None


class _Stamp:
    def __init__(self, graph: Graph, run: Run) -> None:
        self.g = graph
        self.run = run
        self.t_pre, self.l_pre = run.prefix(run.first), run.prefix(run.last)
        blocks = block_ops(graph)
        t_ops, l_ops = blocks.get(self.t_pre, []), blocks.get(self.l_pre, [])
        keys = op_kinds(graph)
        if not t_ops or len(t_ops) != len(l_ops) or any(keys[i] != keys[j] for i, j in zip(t_ops, l_ops, strict=True)):
            raise Unfoldable(f"{self.t_pre} and {self.l_pre} were captured as different ops")
        self.t_ops, self.l_ops = t_ops, l_ops
        self.in_t = {r: (n, k) for n, i in enumerate(t_ops) for k, r in enumerate(graph.ops[i].results)}
        self.in_l = {r: (n, k) for n, i in enumerate(l_ops) for k, r in enumerate(graph.ops[i].results)}
        self.params = {i.value: i for i in graph.inputs if _rename(i.name, self.t_pre, "") is not None}
        self.l_params = {i.value: _rename(i.name, self.l_pre, "") for i in graph.inputs}
        self.fwd_chain: dict[Value, Value] = {}
        """What ``t`` reads from the layer before it → the value of ``t`` that ``l`` reads instead."""
        self.bwd_chain: dict[Value, Value] = {}
        """What ``t`` reads from ``l``'s backward → the value of ``t`` it repeats."""
        # NOTE: what every copy of an op of ``t`` shares is found once, not once per copy
        self.held = {i: _held(graph.ops[i]) for i in t_ops}
        """An op of ``t`` → whether each of its arguments holds a value, and whether any keyword does."""
        self.provs = list(dict.fromkeys(graph.ops[i].prov for i in t_ops))
        """The provenances of ``t``'s ops, each once (a layer's ops have a few dozen)."""
        at = {p: n for n, p in enumerate(self.provs)}
        self.prov_at = {i: at[graph.ops[i].prov] for i in t_ops}
        """An op of ``t`` → the place of its provenance in ``provs``."""
        self.copy_provs = {j: self._provs(run.prefix(j)) for j in run.dropped}
        """Copy ``j`` → its ops' provenances, in the order of ``provs``."""
        self._roles()

    def _in_t(self, v: Value) -> Value:
        """The value of ``t`` that ``l``'s value ``v`` repeats."""
        n, k = self.in_l[v]
        return self.g.ops[self.t_ops[n]].results[k]

    def _roles(self) -> None:
        shared: set[Value] = set()
        for i, j in zip(self.t_ops, self.l_ops, strict=True):
            for x, y in zip(self.g.ops[i].operands, self.g.ops[j].operands, strict=True):
                if x in self.in_t:
                    ok = y in self.in_l and self.in_t[x] == self.in_l[y]
                elif x in self.params:
                    rel = _rename(self.params[x].name, self.t_pre, "")
                    ok = rel is not None and self.l_params.get(y) == rel
                elif x is y:
                    ok = x not in self.in_l
                    shared.add(x)
                elif y in self.in_t:
                    ok = self.fwd_chain.setdefault(x, y) is y
                elif x in self.in_l:
                    self.bwd_chain[x] = self._in_t(x)
                    ok = y not in self.in_l  # NOTE: ``l`` reads the code after the run there
                else:
                    ok = False
                if not ok:
                    op = self.g.ops[i]
                    raise Unfoldable(f"operand {x.name} of {op.describe()} has no counterpart in {self.l_pre}")
        if shared & (self.fwd_chain.keys() | self.bwd_chain.keys()):
            raise Unfoldable(f"a value {self.t_pre} reads is both shared with {self.l_pre} and chained")

    def graph(self) -> Graph:
        g, run = self.g, self.run
        copies = list(run.dropped)
        if not copies:
            return g
        fwd = [i for i in self.t_ops if g.ops[i].prov.phase == "fwd"]
        bwd = [i for i in self.t_ops if g.ops[i].prov.phase == "bwd"]
        if fwd and bwd and max(fwd) > min(bwd):
            raise Unfoldable(f"the backward of {self.t_pre} starts before its forward ends")
        maps: dict[int, dict[Value, Value]] = {j: {} for j in copies}
        inputs = self._inputs(copies, maps)
        l_ops, t_bwd = set(self.l_ops), set(bwd)
        ops: list[Op] = []
        for i, op in enumerate(g.ops):
            if bwd and i == bwd[0]:
                for j in reversed(copies):
                    self._emit(ops, bwd, j, maps)
            if i in l_ops:
                # NOTE: ``l`` reads the last copy where it read ``t`` (the forward chain only)
                op = remap_op(op, {v: maps[copies[-1]][v] for v in op.operands if v in self.in_t})
            elif i in t_bwd:
                op = remap_op(op, {x: maps[copies[0]][t] for x, t in self.bwd_chain.items()})
            ops.append(op)
            if fwd and i == fwd[-1]:
                for j in copies:
                    self._emit(ops, fwd, j, maps)
        outputs = self._outputs(copies, maps)
        stacks = self._stacks(copies)
        out = dataclasses.replace(g, inputs=inputs, ops=tuple(ops), outputs=outputs, stacks=stacks)
        _check_order(out)
        return out

    def _inputs(self, copies: list[int], maps: dict[int, dict[Value, Value]]) -> tuple[GraphInput, ...]:
        out: list[GraphInput] = []
        for inp in self.g.inputs:
            out.append(inp)
            if inp.value not in self.params:
                continue
            for j in copies:
                name = _rename(inp.name, self.t_pre, self.run.prefix(j))
                assert name is not None
                v = Value(name, inp.value.type, inp.value.layout)
                maps[j][inp.value] = v
                out.append(GraphInput(inp.kind, v))
        return tuple(out)

    def _emit(self, ops: list[Op], which: list[int], j: int, maps: dict[int, dict[Value, Value]]) -> None:
        """Copy ``j`` of ``t``'s ops ``which`` (its forward or its backward)."""
        m = maps[j]
        if which and self.g.ops[which[0]].prov.phase == "fwd":
            prev = maps.get(j - 1)
            m.update((x, y if prev is None else prev[y]) for x, y in self.fwd_chain.items())
        else:
            nxt = maps.get(j + 1)
            m.update((x, x if nxt is None else nxt[t]) for x, t in self.bwd_chain.items())
        provs = self.copy_provs[j]
        for i in which:
            op = self.g.ops[i]
            held, kwargs_held = self.held[i]
            results = tuple(Value(f"{r.name}_{j}", r.type, r.layout) for r in op.results)
            m.update(zip(op.results, results, strict=True))
            args = tuple(map_values(a, m) if h else a for a, h in zip(op.args, held, strict=True))
            kwargs = tuple((k, map_values(a, m)) for k, a in op.kwargs) if kwargs_held else op.kwargs
            ops.append(Op(op.target, args, kwargs, results, provs[self.prov_at[i]]))

    def _provs(self, prefix: str) -> list[Provenance]:
        """``provs`` with ``t``'s module path replaced by ``prefix``: those of a copy's ops."""
        out: list[Provenance] = []
        for prov in self.provs:
            module = _rename(prov.module, self.t_pre, prefix)
            out.append(prov if module is None else dataclasses.replace(prov, module=module))
        return out

    def _outputs(self, copies: list[int], maps: dict[int, dict[Value, Value]]) -> tuple[GraphOutput, ...]:
        """``t``'s outputs (its parameters' gradients), then each copy's, in ``t``'s order."""
        mine = [n for n, o in enumerate(self.g.outputs) if o.value in self.in_t or o.value in self.params]
        for n in mine:
            o = self.g.outputs[n]
            if o.kind == "out" or _rename(o.name, self.t_pre, "") is None:
                raise Unfoldable(f"output {o.kind}({o.name}) is a value of {self.t_pre}")
        out = list(self.g.outputs)
        for j in reversed(copies) if mine else ():
            p = self.run.prefix(j)
            stamped = [self.g.outputs[n] for n in mine]
            out[mine[-1] + 1 : mine[-1] + 1] = [
                GraphOutput(o.kind, _rename(o.name, self.t_pre, p) or o.name, maps[j][o.value]) for o in stamped
            ]
        return tuple(out)

    def _stacks(self, copies: list[int]) -> tuple[ParamStack, ...]:
        """``t``'s parameter stacks (its experts), then each copy's."""
        mine = [s for s in self.g.stacks if _rename(s.name, self.t_pre, "") is not None]
        if not mine:
            return self.g.stacks
        at = self.g.stacks.index(mine[-1]) + 1
        stamped = [
            ParamStack(
                _rename(s.name, self.t_pre, self.run.prefix(j)) or s.name,
                tuple(tuple(_rename(m, self.t_pre, self.run.prefix(j)) or m for m in ms) for ms in s.members),
            )
            for j in copies
            for s in mine
        ]
        return (*self.g.stacks[:at], *stamped, *self.g.stacks[at:])


def _held(op: Op) -> tuple[tuple[bool, ...], bool]:
    """Whether each of ``op``'s arguments holds a value (arguments that hold none are kept as they
    are in every copy), and whether any of its keyword arguments does."""
    return tuple(_holds_value(a) for a in op.args), any(_holds_value(a) for _, a in op.kwargs)


def _holds_value(arg: Arg) -> bool:
    if isinstance(arg, Value):
        return True
    return isinstance(arg, tuple) and any(_holds_value(a) for a in arg)


def _check_order(graph: Graph) -> None:
    seen = {i.value for i in graph.inputs}
    for op in graph.ops:
        for v in op.operands:
            if v not in seen:
                raise Unfoldable(f"{op.describe()} reads {v.name} before it is made")
        seen.update(op.results)
