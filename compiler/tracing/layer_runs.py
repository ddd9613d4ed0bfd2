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
captured as its first two and its last layer (``reduced``); ``meshfold.tracing.unroll`` stamps the middle
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
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map_only

from meshfold.tracing.meta_results import SYMBOLIC, MetaResults, leaves

MIN_RUN = 3
"""The shortest run folded: its first and last layers are captured, the one between them stamped."""


@dataclass(frozen=True)
class Run:
    """Layers ``first..last`` of the list at ``path`` run alike; ``first + 1 .. last - 1`` are left out
    of the capture and stamped back as copies of ``first`` (``meshfold.tracing.unroll``)."""

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
        self.alias: dict[int, torch.Tensor] = {}  # a layer's meta copy of a value -> the value
        self.meta = MetaResults()

    def copy(self, x: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """``x`` (a layer's arguments or results) with each tensor replaced by ``make``'s copy of it,
        which reads as the tensor it copies in every later record."""

        def one(t: torch.Tensor) -> torch.Tensor:
            c = make(t)
            self.alias[id(c)] = self.alias.get(id(t), t)
            self.alive.append(c)
            return c

        with _disable_current_modes():
            return tree_map_only(torch.Tensor, one, x)

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
        flat = leaves(args)
        if kwargs:
            leaves(kwargs, flat)  # NOTE: ``leaves((args, kwargs))``, a level of walking less
        out = self.meta.call(func, args, kwargs, flat)
        here, prev, prefix = self.stack[-1] if self.stack else (None, None, "")
        tokens = tuple(self._token(x, here, prev, prefix) for x in flat)
        results = leaves(out)
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
        x = self.alias.get(id(x), x)
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


_SCALARS = (int, float, bool, str, type(None))
"""Python scalars: arguments that are keys as they are."""


def _plain(x: Any) -> Hashable:
    """An argument as a key: a symbolic size by its expression (comparing those would add guards)."""
    if type(x) in _SCALARS:
        # NOTE: nearly every argument and size; asked first, as checking ``Hashable`` costs more
        return x
    if isinstance(x, SYMBOLIC):
        return ("sym", str(x.node.expr))
    return x if isinstance(x, Hashable) else repr(x)


def _lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost layer stacks (``numbered_layers``) that can hold a run (after a first layer)."""
    found: list[tuple[str, nn.Module]] = []
    for path, mod in model.named_modules():
        if any(p == "" or path.startswith(p + ".") for p, _ in found):
            continue
        if numbered_layers(mod) > MIN_RUN:
            found.append((path, mod))
    return found


def numbered_layers(mod: nn.Module) -> int:
    """How many layers ``mod`` holds if it is a layer stack, else 0: an ``nn.ModuleList``,
    ``nn.Sequential`` or ``nn.ModuleDict`` whose children are keyed ``0, 1, ...`` in order (a
    ``ModuleDict`` so keyed is how torchtitan's models hold theirs, so that the FQNs survive a
    pipeline split), so each layer's modules are at ``<path>.<k>``."""
    if not isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        return 0
    keys = list(mod._modules)
    return len(keys) if keys == [str(i) for i in range(len(keys))] else 0


def _record(
    model: nn.Module, inputs: Sequence[Any], lists: list[tuple[str, nn.Module]], meta: _Meta | None = None
) -> _Recorder:
    """Run ``model(*inputs)`` once (on the fake tensors it holds) and record every listed layer; with
    ``meta``, each layer runs on meta copies of what it is given and hands fakes back."""
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    rec = _Recorder(names, inputs)
    handles = []

    def hooks(layer: Layer, prefix: str) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., None]]:
        def enter(_m: nn.Module, args: Any, kwargs: Any) -> Any:
            rec.enter(layer, prefix)
            return None if meta is None else rec.copy((args, kwargs), meta.to_meta)

        def back(_m: nn.Module, _args: Any, out: Any) -> Any:
            return None if meta is None else rec.copy(out, meta.to_fake)

        return enter, back, (lambda *_: rec.leave())

    try:
        for n, (path, mod) in enumerate(lists):
            for key, child in mod._modules.items():
                if child is None:
                    continue
                enter, back, leave = hooks((n, int(key)), f"{path}.{key}" if path else key)
                handles.append(child.register_forward_pre_hook(enter, with_kwargs=True))
                handles.append(child.register_forward_hook(back))
                handles.append(child.register_forward_hook(leave, always_call=True))
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


@dataclass(frozen=True)
class _Meta:
    """Layers recorded on meta tensors: their own parameters are meta, what they are given is copied
    to meta on the way in and what they return to fakes of ``mode`` on ``device`` on the way out.
    Meta kernels cost a fraction of fake dispatch, and the layers are nearly all of a deep model's
    forward; the code around the lists (masks that read data) runs on fakes as before."""

    mode: FakeTensorMode
    device: torch.device

    def to_meta(self, t: torch.Tensor) -> torch.Tensor:
        return _blank(t, None)

    def to_fake(self, t: torch.Tensor) -> torch.Tensor:
        # NOTE: a meta tensor wrapped as a fake directly, as the mode wraps what its kernels return:
        # making one through the mode's dispatch costs several times more, once per layer
        return FakeTensor(self.mode, _blank(t, None), self.device) if t.device.type == "meta" else t


def _blank(t: torch.Tensor, mode: FakeTensorMode | None, device: torch.device | None = None) -> torch.Tensor:
    """A tensor of ``t``'s shape, strides and dtype: a fake of ``mode`` on ``device`` (``t``'s by
    default), or with no mode a meta tensor."""
    if mode is None:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device or t.device)


@contextlib.contextmanager
def _apart(
    model: nn.Module, inputs: Sequence[Any], on_meta: Sequence[nn.Module] = ()
) -> Iterator[tuple[list[Any], _Meta | None]]:
    """The model's tensors and ``inputs`` as fakes of a fake mode of their own, for the duration:
    whatever the recorded forward does to its shape environment (a data-dependent size adds a
    symbol) stays out of the capture's. The tensors of ``on_meta`` (and their submodules) are meta
    instead, and the ``_Meta`` that records them so is yielded (None where the fakes lie on more
    than one device, or none are asked for)."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    meta_ids = {id(m) for layer in on_meta for m in layer.modules()}

    made: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    devices = {x.device for x in inputs if isinstance(x, torch.Tensor)}
    try:
        for mod in model.modules(remove_duplicate=False):
            for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
                for key, t in list(store.items()):
                    if t is None:
                        continue
                    if id(t) not in made:
                        devices.add(t.device)
                        new = _blank(t, None if id(mod) in meta_ids else mode)
                        made[id(t)] = nn.Parameter(new, t.requires_grad) if is_param else new
                    store[key] = made[id(t)]
                    swapped.append((store, key, t))
        meta = _Meta(mode, devices.pop()) if on_meta and len(devices) == 1 else None
        yield [_blank(x, mode) if isinstance(x, torch.Tensor) else x for x in inputs], meta
    finally:
        for store, key, t in reversed(swapped):
            store[key] = t


def find_runs(model: nn.Module, inputs: Sequence[Any]) -> list[Run]:
    """The runs to fold in ``model(*inputs)`` (on fake tensors): for each list called once per layer
    in order, maximal stretches of ``MIN_RUN`` or more layers with equal records, whose left-out
    layers no code outside them reads and which draw no random numbers; none unless the model with
    them left out runs its kept layers exactly as the whole model did.

    The layers are recorded on meta tensors (``_Meta``); where their code cannot run on those (it
    reads data, or mixes in a tensor of its own), on fakes."""
    lists = _lists(model)
    if not lists:
        return []
    layers = [child for _, mod in lists for child in mod.children()]
    try:
        return _found(model, inputs, lists, layers)
    except Exception:
        return _found(model, inputs, lists, [])


def _found(
    model: nn.Module, inputs: Sequence[Any], lists: list[tuple[str, nn.Module]], on_meta: Sequence[nn.Module]
) -> list[Run]:
    with _apart(model, inputs, on_meta) as (apart, meta):
        if on_meta and meta is None:
            raise ValueError("the model's tensors lie on more than one device")
        try:
            whole = _record(model, apart, lists, meta)
        except Exception:
            if meta is not None:
                raise
            # NOTE: a forward fake tensors cannot run as they are (it reads data): nothing is folded,
            # and the capture proper reports what is wrong with it
            return []
        runs = _runs(whole, lists)
        if not runs:
            return []
        with reduced(model, runs):
            part = _record(model, apart, lists, meta)
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
