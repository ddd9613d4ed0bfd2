"""Runs of identical layers, found before capture so that dynamo and AOTAutograd trace each kind once.

A 32-layer decoder is 32 calls of one layer: tracing all of them costs dynamo and AOTAutograd time
linear in depth for a graph whose middle layers differ only in which parameters they read. Before
capture the model's forward runs once on fake tensors (nothing is allocated, nothing is compiled)
under a dispatch mode that records, for every layer of an ``nn.ModuleList`` or ``nn.Sequential``, the
ATen ops it ran: the op, its non-tensor arguments, its result shapes, and where each tensor it read
came from (its own ops, the previous layer's ops, ops before the list, its own parameters by
relative name, the model's inputs, or one fixed tensor). Layers ``a..b`` of a list whose records are
equal are a *run*: each reads its predecessor exactly as the next reads it, and the same shared
tensors (a layer given a different mask than its neighbour differs). A run of three or more is
captured as its first two and its last layer (``reduced``); ``meshfold.unroll`` stamps the middle
copies back into the captured graph, forward and backward, each reading its own parameters.

Nothing is folded where the record cannot vouch for it: a layer called twice or out of order, one
whose values the code around the list reads (hidden states collected for the output, an auxiliary
loss summed at the end), random ops (each copy would need its own draws), or a reduced model whose
kept layers do not run exactly as they ran in the whole model (code that branches on the position
in the list).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

MIN_RUN = 3
"""The shortest run folded: its first and last layers are captured, the one between them stamped."""


@dataclass(frozen=True)
class Run:
    """Layers ``first..last`` of the list at ``path`` run alike; ``first + 1 .. last - 1`` are left out
    of the capture and stamped back as copies of ``first`` (``meshfold.unroll``)."""

    path: str
    first: int
    last: int

    def prefix(self, i: int) -> str:
        return f"{self.path}.{i}" if self.path else str(i)

    @property
    def dropped(self) -> range:
        return range(self.first + 1, self.last)


Layer = tuple[int, int]
"""(list number, position in the list)."""


class _Recorder(TorchDispatchMode):
    """Records what each layer of the watched lists dispatches (see the module docstring)."""

    def __init__(self, names: dict[int, str], inputs: Sequence[Any]) -> None:
        super().__init__()
        self.names = names
        self.inputs = {id(x): k for k, x in enumerate(inputs) if isinstance(x, torch.Tensor)}
        self.stack: list[tuple[Layer, Layer | None, str]] = []
        self.made: dict[int, tuple[Layer | None, int, int]] = {}
        self.alive: list[Any] = []  # NOTE: holds every result so that no id is reused while recording
        self.records: dict[Layer, list[Hashable]] = {}
        self.calls: dict[int, list[int]] = {}
        self.leaked: set[Layer] = set()
        self.root_ops = 0

    def enter(self, layer: Layer, prefix: str) -> None:
        called = self.calls.setdefault(layer[0], [])
        prev = (layer[0], called[-1]) if called else None
        called.append(layer[1])
        self.stack.append((layer, prev, prefix))
        self.records.setdefault(layer, [])

    def leave(self) -> None:
        self.stack.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        here, prev, prefix = self.stack[-1] if self.stack else (None, None, "")
        tokens = tuple(self._token(x, here, prev, prefix) for x in _leaves((args, kwargs)))
        results = list(_leaves(out))
        shapes = tuple((tuple(map(_plain, r.shape)), r.dtype) for r in results if isinstance(r, torch.Tensor))
        if here is None:
            index = self.root_ops
            self.root_ops += 1
        else:
            index = len(self.records[here])
            self.records[here].append((func, tokens, shapes))
        for k, r in enumerate(results):
            if isinstance(r, torch.Tensor):
                self.made[id(r)] = (here, index, k)
                self.alive.append(r)
        return out

    def _token(self, x: Any, here: Layer | None, prev: Layer | None, prefix: str) -> Hashable:
        if not isinstance(x, torch.Tensor):
            return _plain(x)
        made = self.made.get(id(x))
        if made is not None:
            where, index, k = made
            if where is None:
                return ("root", index, k)
            if where == here:
                return ("own", index, k)
            if where == prev:
                return ("prev", index, k)
            # NOTE: a value of a layer read anywhere but in itself and the next layer: the code
            # around the list (or a later layer) reaches into it, and the layer cannot be left out.
            self.leaked.add(where)
            return ("far", where, index, k)
        name = self.names.get(id(x))
        if name is not None:
            return ("param", name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name)
        if id(x) in self.inputs:
            return ("input", self.inputs[id(x)])
        return ("tensor", id(x))


def _leaves(x: Any) -> Iterator[Any]:
    """The leaves of an ATen op's arguments or results (tuples, lists and dicts of them), in
    ``tree_flatten``'s order; a plain walk, as every op of the recorded forward is flattened."""
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)
    else:
        yield x


def _plain(x: Any) -> Hashable:
    """An argument as a key: a symbolic size by its expression (comparing those would add guards)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(x.node.expr))
    return x if isinstance(x, Hashable) else repr(x)


def _lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``nn.ModuleList``/``nn.Sequential`` that can hold a run (after a first layer),
    keyed by their positions."""
    found: list[tuple[str, nn.Module]] = []
    for path, mod in model.named_modules():
        if any(p == "" or path.startswith(p + ".") for p, _ in found):
            continue
        if (
            isinstance(mod, (nn.ModuleList, nn.Sequential))
            and len(mod) > MIN_RUN
            and list(mod._modules) == [str(i) for i in range(len(mod))]
        ):
            found.append((path, mod))
    return found


def _record(model: nn.Module, inputs: Sequence[Any], lists: list[tuple[str, nn.Module]]) -> _Recorder:
    """Run ``model(*inputs)`` once (on the fake tensors it holds) and record every listed layer."""
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    rec = _Recorder(names, inputs)
    handles = []

    def hooks(layer: Layer, prefix: str) -> tuple[Callable[..., None], Callable[..., None]]:
        return (lambda *_: rec.enter(layer, prefix)), (lambda *_: rec.leave())

    try:
        for n, (path, mod) in enumerate(lists):
            for key, child in mod._modules.items():
                if child is None:
                    continue
                pre, post = hooks((n, int(key)), f"{path}.{key}" if path else key)
                handles.append(child.register_forward_pre_hook(pre))
                handles.append(child.register_forward_hook(post, always_call=True))
        # NOTE: without autograd (no graph is built); whole and reduced models are recorded alike
        with rec, torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return rec


def _runs(rec: _Recorder, lists: list[tuple[str, nn.Module]]) -> list[Run]:
    runs: list[Run] = []
    for n, (path, mod) in enumerate(lists):
        if rec.calls.get(n) != list(range(len(mod))):
            continue
        i = 1
        while i < len(mod):
            j = i
            while j + 1 < len(mod) and rec.records[(n, j + 1)] == rec.records[(n, i)]:
                j += 1
            if j - i + 1 >= MIN_RUN and not any((n, k) in rec.leaked for k in range(i, j)):
                runs.append(Run(path, i, j))
            i = j + 1
    return runs


@contextlib.contextmanager
def _apart(model: nn.Module, inputs: Sequence[Any]) -> Iterator[list[Any]]:
    """The model's tensors and ``inputs`` as fakes of a fake mode of their own, for the duration:
    whatever the recorded forward does to its shape environment (a data-dependent size adds a
    symbol) stays out of the capture's."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)

    def fresh(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)

    made: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for mod in model.modules(remove_duplicate=False):
            for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
                for key, t in list(store.items()):
                    if t is None:
                        continue
                    if id(t) not in made:
                        made[id(t)] = nn.Parameter(fresh(t), t.requires_grad) if is_param else fresh(t)
                    store[key] = made[id(t)]
                    swapped.append((store, key, t))
        yield [fresh(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    finally:
        for store, key, t in reversed(swapped):
            store[key] = t


def find_runs(model: nn.Module, inputs: Sequence[Any]) -> list[Run]:
    """The runs to fold in ``model(*inputs)`` (on fake tensors): for each list called once per layer
    in order, maximal stretches of ``MIN_RUN`` or more layers with equal records, whose left-out
    layers no code outside them reads and which draw no random numbers; none unless the model with
    them left out runs its kept layers exactly as the whole model did."""
    lists = _lists(model)
    if not lists:
        return []
    with _apart(model, inputs) as apart:
        try:
            whole = _record(model, apart, lists)
        except Exception:
            # NOTE: a forward fake tensors cannot run as they are (it reads data): nothing is folded,
            # and the capture proper reports what is wrong with it
            return []
        runs = _runs(whole, lists)
        if not runs:
            return []
        with reduced(model, runs):
            part = _record(model, apart, lists)
            kept = {n: [int(k) for k in mod._modules] for n, (_, mod) in enumerate(lists)}
    if any(part.calls.get(n, []) != keys for n, keys in kept.items()):
        return []
    if any(part.records[layer] != whole.records[layer] for layer in part.records):
        return []
    return runs


@contextlib.contextmanager
def reduced(model: nn.Module, runs: Sequence[Run]) -> Iterator[None]:
    """The model with each run's middle layers taken out of their list (the kept layers keep their
    names: ``layers.0``, ``layers.1``, ``layers.31``); restored afterwards."""
    lists = dict(model.named_modules())
    saved: list[tuple[nn.Module, dict[str, nn.Module | None]]] = []
    try:
        for run in runs:
            mod = lists[run.path]
            saved.append((mod, dict(mod._modules)))
            for i in run.dropped:
                del mod._modules[str(i)]
        yield
    finally:
        for mod, modules in reversed(saved):
            mod._modules.clear()
            mod._modules.update(modules)
