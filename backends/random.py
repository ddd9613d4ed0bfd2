"""Random ops on one rank: the values of the whole tensor, this rank's part of them.

A random op (dropout, ``rand_like``, ``randn``, ``bernoulli``, the samplers ``exponential_``,
``uniform_`` and ``normal_``) must give the same
value to every rank that holds the same logical element, and different values to different shards
of one tensor, whatever each rank's own seed is. Every rank therefore draws the op's values for its **global**
shape from the program's own generator (``torch.Generator``, its state taken from rank 0's default
generator when the program is compiled, advanced by every call alike on all ranks) and keeps the
slice its result layout gives it (``Layout.shard_bounds``). With the same generator state, the
draws are the single-device model's own: dropout's mask is ``bernoulli_(1 - p)`` on a tensor of
the input's shape on one device and here alike, so a program seeded as the model was gives its
masks exactly.

NOTE: each rank draws the whole tensor and drops what other shards hold, so random work is not
divided by the mesh (a CPU generator cannot skip ahead; a counter-based generator such as CUDA's
Philox can, by offset). Random ops outside ``RANDOM`` raise at lowering, before any collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshfold.ir import Mesh, Op, Partial, TensorType
from meshfold.ir.ops import draws
from meshfold.passes.base import PassError

aten = torch.ops.aten

Draw = Callable[[torch.Generator, tuple[int, ...], tuple[Any, ...], dict[str, Any]], torch.Tensor]
"""(generator, global shape, the op's first operand or None, kwargs) -> the random draw for the whole
tensor, before the op combines it with its local operands."""


def _dtype(kwargs: dict[str, Any], like: torch.Tensor | None) -> torch.dtype:
    dtype = kwargs.get("dtype")
    if dtype is not None:
        return dtype  # type: ignore[no-any-return]
    return like.dtype if like is not None else torch.get_default_dtype()


def _uniform(
    gen: torch.Generator, shape: tuple[int, ...], like: torch.Tensor | None, kw: dict[str, Any]
) -> torch.Tensor:
    return torch.empty(shape, dtype=_dtype(kw, like)).uniform_(0.0, 1.0, generator=gen)


def _normal(
    gen: torch.Generator, shape: tuple[int, ...], like: torch.Tensor | None, kw: dict[str, Any]
) -> torch.Tensor:
    return torch.empty(shape, dtype=_dtype(kw, like)).normal_(0.0, 1.0, generator=gen)


class RandomSite:
    """One random op of a lowered program: calls draw the global values and keep this rank's slice.

    An instance is the fx node's target (fx calls any callable with a ``__name__``), so the generator
    it holds is the one every call of the program advances."""

    def __init__(
        self, name: str, generator: torch.Generator, global_shape: tuple[int, ...], bounds: tuple[tuple[int, int], ...]
    ) -> None:
        self.name = name
        self.generator = generator
        self.global_shape = global_shape
        self.bounds = bounds
        self.__name__ = f"random_{name.replace('.', '_')}"
        self.__module__ = __name__

    def _local(self, whole: torch.Tensor) -> torch.Tensor:
        for dim, (lo, size) in enumerate(self.bounds):
            if size != whole.shape[dim]:
                whole = whole.narrow(dim, lo, size)
        return whole.contiguous()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _FORMS[self.name](self, args, kwargs)


def _dropout(site: RandomSite, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    x, p, train = args
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    # NOTE: as ATen's CPU kernel: a mask of the input's dtype by bernoulli_(1 - p), scaled after
    mask = site._local(torch.empty(site.global_shape, dtype=x.dtype).bernoulli_(1.0 - p, generator=site.generator))
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x.mul(mask).mul_(scale), mask.bool()


def _like(draw: Callable[..., torch.Tensor]) -> Callable[[RandomSite, tuple[Any, ...], dict[str, Any]], torch.Tensor]:
    def form(site: RandomSite, args: tuple[Any, ...], kw: dict[str, Any]) -> torch.Tensor:
        like = args[0] if args and isinstance(args[0], torch.Tensor) else None
        out = site._local(draw(site.generator, site.global_shape, like, kw))
        device = kw.get("device") or (like.device if like is not None else None)
        return out.to(device) if device is not None else out

    return form


def _sampled(method: str, *names: str) -> Callable[[RandomSite, tuple[Any, ...], dict[str, Any]], torch.Tensor]:
    """The form of a functional in-place sampler (``exponential_``, ``uniform_``, ``normal_``): a tensor
    of the operand's dtype and the global shape filled by ``Tensor.<method>`` with the op's parameters
    (``names``, by position or keyword; a parameter the op leaves out keeps ATen's default)."""

    def form(site: RandomSite, args: tuple[Any, ...], kw: dict[str, Any]) -> torch.Tensor:
        x = args[0]
        params = dict(zip(names, args[1:], strict=False)) | {k: v for k, v in kw.items() if k in names}
        whole = getattr(torch.empty(site.global_shape, dtype=x.dtype), method)(**params, generator=site.generator)
        return site._local(whole).to(x.device)

    return form


def _bernoulli_p(site: RandomSite, args: tuple[Any, ...], kw: dict[str, Any]) -> torch.Tensor:
    x = args[0]
    p = args[1] if len(args) > 1 else kw.get("p", 0.5)
    whole = torch.empty(site.global_shape, dtype=x.dtype).bernoulli_(p, generator=site.generator)
    return site._local(whole)


_FORMS: dict[str, Callable[[RandomSite, tuple[Any, ...], dict[str, Any]], Any]] = {
    "native_dropout": _dropout,
    "rand_like": _like(_uniform),
    "randn_like": _like(_normal),
    "rand": _like(_uniform),
    "randn": _like(_normal),
    "bernoulli.p": _bernoulli_p,
    "exponential": _sampled("exponential_", "lambd"),
    "uniform": _sampled("uniform_", "from", "to"),
    "normal": _sampled("normal_", "mean", "std"),
}

OPERAND_DTYPE = frozenset({"bernoulli.p", "exponential", "uniform", "normal"})
"""The forms whose one result has their tensor operand's dtype (dropout has two results; the
factories take ``dtype=`` or the default)."""

RANDOM: dict[Any, str] = {
    aten.native_dropout.default: "native_dropout",
    aten.rand_like.default: "rand_like",
    aten.randn_like.default: "randn_like",
    aten.rand.default: "rand",
    aten.randn.default: "randn",
    aten.bernoulli.p: "bernoulli.p",
    aten.exponential.default: "exponential",
    aten.uniform.default: "uniform",
    aten.normal_functional.default: "normal",
}
"""The random ops a program may hold, by the form that draws them."""


def is_random(op: Op) -> bool:
    """Whether ``op`` draws from a generator (``ir.ops.draws``, or one of the random forms above)."""
    return op.target in RANDOM or draws(op)


def random_site(op: Op, generator: torch.Generator, mesh: Mesh, coord: Sequence[int]) -> RandomSite:
    """The callable that computes ``op`` on the rank at ``coord``; raises ``PassError`` naming the op
    for a random op meshfold cannot split (every rank alike, before anything runs)."""
    name = RANDOM.get(op.target)
    if name is None and "dropout_p" in str(getattr(op.target, "_schema", "")):
        raise PassError(
            f"{op.describe()}: {op.target} applies dropout inside a fused attention kernel, whose mask meshfold "
            "cannot split like the single-device model's; set the model's attention dropout to 0 (for Hugging "
            "Face models: attention_dropout / attn_pdrop in the config), or dropout the attention output instead"
        )
    if name is None:
        raise PassError(
            f"{op.describe()}: random op {op.target} has no split form in meshfold; its values would differ "
            f"from one device's. Supported: {', '.join(sorted(set(RANDOM.values())))}; draw the values "
            "outside the model and pass them in as an input"
        )
    result = op.results[0]
    assert isinstance(result.type, TensorType)
    layout = result.layout
    if any(isinstance(p, Partial) for p in layout.placements):
        raise ValueError(f"{op.describe()}: a random value cannot be a partial sum; this is a sharding bug")
    shape = tuple(int(d) for d in result.type.shape)
    bounds = tuple((int(lo), int(size)) for lo, size in layout.shard_bounds(shape, mesh, coord))
    return RandomSite(name, generator, shape, bounds)


def _meta(site: RandomSite, args: tuple[Any, ...], kw: dict[str, Any]) -> list[tuple[torch.dtype, torch.device]]:
    """The dtype and device of each result of ``site`` called on ``args``/``kw`` (every result has
    this rank's shape of the op's value)."""
    like = args[0] if args and isinstance(args[0], torch.Tensor) else None
    device = torch.device(kw.get("device") or (like.device if like is not None else "cpu"))
    if site.name == "native_dropout":
        assert like is not None
        return [(like.dtype, device), (torch.bool, device)]
    if site.name in OPERAND_DTYPE:
        assert like is not None
        return [(like.dtype, device)]
    return [(_dtype(kw, like), device)]


_CALLS: dict[int, tuple[RandomSite, tuple[Any, ...], dict[str, Any]]] = {}
"""The random calls of compiled programs, by the key their ``meshfold::random_call`` node holds: the
site and its arguments, ``None`` where a tensor operand goes. Programs live as long as the process
(a module keeps its programs), so entries are never dropped."""


def _bound(key: int, tensors: list[torch.Tensor]) -> tuple[RandomSite, tuple[Any, ...], dict[str, Any]]:
    site, template, kw = _CALLS[key]
    given = iter(tensors)
    return site, tuple(next(given) if a is None else a for a in template), kw


@torch.library.custom_op("meshfold::random_call", mutates_args=())
def random_call(key: int, tensors: list[torch.Tensor], what: str) -> list[torch.Tensor]:
    """One random op of a compiled program, drawn by its ``RandomSite`` from meshfold's generator as
    the eager program draws it (a compiler calls it as it is and keeps the calls in program order).
    ``what`` spells the site and its arguments: unused here, it makes two different draws two
    different graphs to a compiler's cache, whatever their keys."""
    site, args, kw = _bound(key, tensors)
    out = site(*args, **kw)
    return list(out) if isinstance(out, tuple) else [out]


@random_call.register_fake
def _(key: int, tensors: list[torch.Tensor], what: str) -> list[torch.Tensor]:
    site, args, kw = _bound(key, tensors)
    shape = tuple(size for _, size in site.bounds)
    return [torch.empty(shape, dtype=dtype, device=device) for dtype, device in _meta(site, args, kw)]


# NOTE: ordered, so a compiler neither reorders two draws nor drops one whose result goes unused:
# each advances the generator, and the next draws must see it advanced as the eager program does
torch._higher_order_ops.effects._register_effectful_op(
    torch.ops.meshfold.random_call.default, torch._higher_order_ops.effects._EffectType.ORDERED
)


def as_random_call(site: RandomSite, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[tuple[Any, ...], bool]:
    """Register ``site`` called on ``args``/``kw`` (fx nodes among them) for ``random_call``: the
    call's arguments (key, tensor operands, description) and whether the site returns a tuple
    (dropout's output and mask)."""
    key = len(_CALLS)
    template = tuple(None if isinstance(a, torch.fx.Node) else a for a in args)
    _CALLS[key] = (site, template, kw)
    what = f"{site.name} of {site.global_shape} at {site.bounds} on {template} {sorted(kw.items())}"
    return (key, [a for a in args if isinstance(a, torch.fx.Node)], what), site.name == "native_dropout"
