"""Generated corpus entries: decoder LMs drawn from a small grammar of the blocks real decoder code is
made of.

A ``ModelSpec`` is one choice per axis of the grammar (``CHOICES`` lists every axis and its values):

* ``residual``: ``sequential`` (``x + attn(n1(x))``, then ``x + mlp(n2(x))``), ``parallel``
  (``x + attn(n1(x)) + mlp(n2(x))``, GPT-NeoX) or ``parallel-shared`` (one norm feeds both, Phi);
* ``bias``: a bias on every projection and norm, or on none (expert and router Linears never have one);
* ``norm``: ``layernorm`` (``nn.LayerNorm``) or ``rmsnorm`` (ours, computed in fp32);
* ``tied``: the LM head shares the token embedding's weight;
* ``position``: ``rope`` (real cos/sin tables, ``rotate_half``, HF style), ``complex-rope`` (a
  complex64 ``freqs_cis`` table applied through ``view_as_complex``/``view_as_real``, torchtitan
  style) or ``learned`` (a position embedding added to the token embedding);
* ``rotary``: the fraction of each head's dimensions rotated (``1.0`` or ``0.5``; always ``1.0``
  under learned positions, which rotate nothing);
* ``qk_norm``: a norm over each head's queries and keys before the rotation;
* ``kv_heads``: 4 (MHA), 2 (GQA) or 1 (MQA) key/value heads for 4 query heads;
* ``window``: 0 (full causal attention, ``is_causal=True``) or 8 (a sliding-window mask over the
  sequence of 16, built in the forward);
* ``mlp``: ``gelu``, ``swiglu``, ``moe`` (4 routed SwiGLU experts, top-2 of a softmax router,
  a loop over an ``nn.ModuleList`` of bias-free experts with ``torch.where``/``index_add_``) or
  ``moe+shared`` (the same plus an always-on shared expert);
* ``dispatch``: how an MoE's loop finds each expert's tokens: ``one-hot`` (HF Mixtral's
  ``one_hot(top_k).permute(2, 1, 0)``, then ``slot, rows = torch.where(mask[e])``) or ``where-eq``
  (``rows, slot = torch.where(top_k == e)``); always ``one-hot`` for a dense MLP;
* ``container``: the layer stack as an ``nn.ModuleList`` or an ``nn.ModuleDict`` keyed ``"0"``,
  ``"1"``, ... (the model hands each layer its rotary table), or an ``nn.Sequential`` (each layer
  takes and returns one tensor, so each attention holds its own rotary table);
* ``tables``: whether the position tables (cos/sin, ``freqs_cis``, ``position_ids``) are
  ``persistent`` buffers or ``non-persistent`` ones (every model also has a persistent ``logit_scale``);
* ``dropout``: p=0.1 on the attention and MLP branches (trait ``random``) or none;
* ``output``: the loss alone, a ``(loss, tokens, tag)`` tuple or a ``{"loss", "tokens", "tag"}`` dict;
* ``layers``: 2 or 4 (trait ``deep``).

Every model is 64 wide with 4 heads of 16, a vocabulary of 256, trained on 8 sequences of 16 tokens
(next-token cross entropy); its weights are seeded, so two builds are the same.

``draw(seed, n)`` returns ``n`` distinct specs for ``seed``, drawn by ``hypothesis`` from
``model_specs()`` (see ``draw`` for how that is deterministic and covers every choice); entry
``gen-<seed>-<i>`` is the model of ``draw(seed, i + 1)[i]``. The first ``GENERATED`` specs of
``GENERATED_SEED`` are registered as the corpus's default generated rows.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from meshfold.tools.corpus.catalog import Built, Entry, register, seeded, tokens
from meshfold.tools.corpus.entries.real_blocks import VOCAB, WINDOW, GeneratedLM

GENERATED_SEED = 0
GENERATED = 10
"""The registered generated entries: ``gen-0-0`` .. ``gen-0-9``."""

CHOICES: dict[str, tuple[Any, ...]] = {
    "residual": ("sequential", "parallel", "parallel-shared"),
    "bias": (False, True),
    "norm": ("rmsnorm", "layernorm"),
    "tied": (False, True),
    "position": ("rope", "complex-rope", "learned"),
    "rotary": (1.0, 0.5),
    "qk_norm": (False, True),
    "kv_heads": (4, 2, 1),
    "window": (0, WINDOW),
    "mlp": ("swiglu", "gelu", "moe", "moe+shared"),
    "dispatch": ("one-hot", "where-eq"),
    "container": ("ModuleList", "ModuleDict", "Sequential"),
    "tables": ("non-persistent", "persistent"),
    "dropout": (False, True),
    "output": ("loss", "tuple", "dict"),
    "layers": (2, 4),
}
"""Every axis of the grammar (a ``ModelSpec`` field) and its values."""


# ---------------------------------------------------------------------------------------------------
# The spec


@dataclass(frozen=True)
class ModelSpec:
    """One generated model: a value of ``CHOICES`` per field (the module docstring says what each
    means). ``str(spec)`` is its compact description, the entry's note."""

    residual: str = "sequential"
    bias: bool = False
    norm: str = "rmsnorm"
    tied: bool = False
    position: str = "rope"
    rotary: float = 1.0
    qk_norm: bool = False
    kv_heads: int = 4
    window: int = 0
    mlp: str = "swiglu"
    dispatch: str = "one-hot"
    container: str = "ModuleList"
    tables: str = "non-persistent"
    dropout: bool = False
    output: str = "loss"
    layers: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) not in CHOICES[f.name]:
                raise ValueError(f"ModelSpec.{f.name} = {getattr(self, f.name)!r} is not one of {CHOICES[f.name]}")
        if self.position == "learned" and self.rotary != 1.0:
            raise ValueError("ModelSpec: learned positions rotate nothing (rotary must be 1.0)")
        if not self.moe and self.dispatch != "one-hot":
            raise ValueError("ModelSpec: a dense MLP routes nothing (dispatch must be 'one-hot')")

    @property
    def moe(self) -> bool:
        return self.mlp.startswith("moe")

    @property
    def traits(self) -> frozenset[str]:
        """The corpus traits of the model (``registry.TRAITS``)."""
        out = {"attention", "tokens", "stack"}
        if self.layers >= 4:
            out.add("deep")
        if self.moe:
            out.add("moe")
        if self.dropout:
            out.add("random")
        return frozenset(out)

    def __str__(self) -> str:
        position = self.position + (f" {self.rotary:g}" if self.rotary != 1.0 else "")
        heads = {4: "mha", 2: "gqa", 1: "mqa"}[self.kv_heads]
        parts = [
            self.residual,
            "bias" if self.bias else "no-bias",
            self.norm,
            "tied" if self.tied else "untied",
            position,
            *(["qk-norm"] if self.qk_norm else []),
            heads,
            f"window {self.window}" if self.window else "causal",
            self.mlp + (f" {self.dispatch}" if self.moe else ""),
            self.container,
            f"{self.tables} tables",
            *(["dropout"] if self.dropout else []),
            f"{self.output}-out",
            f"{self.layers} layers",
        ]
        return ", ".join(parts)


def canonical(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the choices its other choices make moot set to their default (a learned
    position table rotates nothing, a dense MLP routes nothing)."""
    if spec.position == "learned":
        spec = replace(spec, rotary=1.0)
    if not spec.moe:
        spec = replace(spec, dispatch="one-hot")
    return spec


@st.composite
def model_specs(draw: Callable[[st.SearchStrategy[Any]], Any]) -> ModelSpec:
    """A hypothesis strategy over ``ModelSpec``: every field from its ``CHOICES`` (the rotated
    fraction only when the position encoding is a rotary one, the dispatch only for an MoE)."""
    moot = ("rotary", "dispatch")
    picks = {name: draw(st.sampled_from(values)) for name, values in CHOICES.items() if name not in moot}
    rotary = draw(st.sampled_from(CHOICES["rotary"])) if picks["position"] != "learned" else 1.0
    dispatch = draw(st.sampled_from(CHOICES["dispatch"])) if picks["mlp"].startswith("moe") else "one-hot"
    return ModelSpec(rotary=rotary, dispatch=dispatch, **picks)


# ---------------------------------------------------------------------------------------------------
# Drawing specs

EXAMPLES = 100
"""Examples each seed's hypothesis run generates (fixed: hypothesis's generation depends on
``max_examples``, so a fixed count keeps every prefix of the stream the same whatever ``n`` is)."""
COVERED = 8
"""``draw`` makes its first this many specs cover every value of ``CHOICES``."""


def draw(seed: int, n: int) -> list[ModelSpec]:
    """``n`` distinct specs for ``seed``, the same in every process.

    Determinism: one hypothesis run of ``model_specs()`` under ``@seed(seed)`` (its random source is
    then ``Random(seed)``, whatever the settings profile or ``--hypothesis-seed``), with no example
    database, only the generate phase (no explicit examples, no replay, no shrinking), no deadline
    and no health checks, so nothing depends on timing or on files; it always generates ``EXAMPLES``
    examples, whose distinct specs in the order drawn are the seed's stream.

    Order and coverage: hypothesis's first examples are its simplest ones (the first is every
    axis's first value, a plain Llama, and the next few differ from it in one or two choices), so
    the stream is reordered farthest-first (``spread``: the simplest spec stays first as the
    baseline, then each next spec is the one least like any placed so far), which makes the first
    few specs as unlike as the stream allows. Then ``cover`` checks the first ``COVERED`` specs hold
    every value of every axis and, where they do not (about one seed in six), changes single choices
    of specs whose value another spec also holds until they do (never making two specs equal). The
    rest of the order follows, without the specs ``cover`` made. So ``draw(seed, n)`` is a prefix of
    ``draw(seed, m)`` for ``n <= m``, and for ``n >= COVERED`` it holds every choice.

    Hypothesis refuses an ``@given`` run inside another one unless the outer test suppresses
    ``HealthCheck.nested_given``: inside a hypothesis test, draw a seed other than ``GENERATED_SEED``
    (drawn at import) only with that suppressed (the specs are the same either way)."""
    specs = _covered(seed)
    if n > len(specs):
        raise ValueError(f"draw({seed}, {n}): seed {seed}'s stream has only {len(specs)} distinct specs")
    return list(specs[:n])


@functools.cache
def _covered(seed: int) -> tuple[ModelSpec, ...]:
    order = spread(_stream(seed))
    head = cover(list(order[:COVERED]))
    return tuple(head + [s for s in order[COVERED:] if s not in head])


def distance(a: ModelSpec, b: ModelSpec) -> int:
    """How many choices ``a`` and ``b`` make differently."""
    return sum(getattr(a, f) != getattr(b, f) for f in CHOICES)


def spread(specs: tuple[ModelSpec, ...]) -> list[ModelSpec]:
    """``specs`` reordered farthest-first: the first stays first, then each next one is the
    earliest of those left whose fewest differences from any spec already placed is the most."""
    if not specs:
        return []
    order, left = [specs[0]], list(specs[1:])
    nearest = [distance(s, specs[0]) for s in left]
    while left:
        pick = max(range(len(left)), key=lambda i: (nearest[i], -i))
        chosen = left.pop(pick)
        nearest.pop(pick)
        order.append(chosen)
        nearest = [min(d, distance(s, chosen)) for s, d in zip(left, nearest, strict=True)]
    return order


@functools.cache
def _stream(seed: int) -> tuple[ModelSpec, ...]:
    """The distinct specs of ``seed``'s hypothesis run, in the order drawn."""
    seen: list[ModelSpec] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=EXAMPLES,
        database=None,
        derandomize=False,
        phases=(Phase.generate,),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )
    @given(model_specs())
    def collect(spec: ModelSpec) -> None:
        spec = canonical(spec)
        if spec not in seen:
            seen.append(spec)

    collect()
    return tuple(seen)


def coverage(specs: list[ModelSpec]) -> set[tuple[str, Any]]:
    """The (field, value) pairs of ``CHOICES`` that ``specs`` hold."""
    return {(f, getattr(s, f)) for s in specs for f in CHOICES}


def missing(specs: list[ModelSpec]) -> list[tuple[str, Any]]:
    """The (field, value) pairs of ``CHOICES`` that no spec of ``specs`` holds, in ``CHOICES``' order."""
    held = coverage(specs)
    return [(f, v) for f, values in CHOICES.items() for v in values if (f, v) not in held]


def cover(specs: list[ModelSpec]) -> list[ModelSpec]:
    """``specs`` changed, one choice of one spec at a time, until they hold every value of every
    axis: a missing value goes to the last spec whose change to it keeps every value held so far,
    changes what the spec holds (``rotary`` needs a rotary position, ``dispatch`` an MoE), and keeps
    the specs distinct. Raises ``ValueError`` if no such change is left (with 8 or more specs there
    always is one in practice: no axis has more than 4 values, so some value of it is held twice)."""
    specs = list(specs)
    while todo := missing(specs):
        held = coverage(specs)
        for field, value in todo:
            changed = _cover_one(specs, field, value, held)
            if changed is not None:
                specs = changed
                break
        else:
            raise ValueError(f"cannot cover {todo} with {len(specs)} specs")
    return specs


def _with(spec: ModelSpec, field: str, value: Any) -> ModelSpec | None:
    """``spec`` with ``field`` set to ``value`` and the choices that makes moot reset (a dense MLP's
    dispatch); None if the spec's other choices make ``value`` itself moot (a rotated fraction under
    learned positions)."""
    picks = {f.name: getattr(spec, f.name) for f in fields(spec)} | {field: value}
    if picks["position"] == "learned":
        picks["rotary"] = 1.0
    if not picks["mlp"].startswith("moe"):
        picks["dispatch"] = "one-hot"
    return ModelSpec(**picks) if picks[field] == value else None


def _cover_one(specs: list[ModelSpec], field: str, value: Any, held: set[tuple[str, Any]]) -> list[ModelSpec] | None:
    for i in reversed(range(len(specs))):
        new = _with(specs[i], field, value)
        if new is None or new in specs:
            continue
        changed = [*specs[:i], new, *specs[i + 1 :]]
        if coverage(changed) >= held | {(field, value)}:
            return changed
    return None


# ---------------------------------------------------------------------------------------------------
# Entries


def build(spec: ModelSpec, weights_seed: int = 0) -> Built:
    """``(model, (input_ids, labels))`` of ``spec``: the same weights and tokens every call."""
    ids = tokens(VOCAB)
    return seeded(lambda: GeneratedLM(spec), weights_seed), (ids, ids.clone())


LOSS: dict[str, Callable[[Any], torch.Tensor]] = {
    "loss": lambda out: out,
    "tuple": operator.itemgetter(0),
    "dict": operator.itemgetter("loss"),
}
"""How ``Entry.loss`` reads the loss from each output form."""


def make_entry(seed: int, index: int, spec: ModelSpec) -> Entry:
    """The corpus entry ``gen-<seed>-<index>`` of ``spec``."""
    return Entry(
        f"gen-{seed}-{index}",
        "generated",
        "generated",
        functools.partial(build, spec),
        spec.traits,
        loss=LOSS[spec.output],
        note=str(spec),
    )


_NAME = re.compile(r"gen-(\d+)-(\d+)")


def entry_named(name: str) -> Entry:
    """The generated entry ``name`` (``gen-<seed>-<i>``: the model of ``draw(seed, i + 1)[i]``)."""
    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"unknown generated entry {name!r} (generated entries are named gen-<seed>-<index>)")
    seed, index = int(m[1]), int(m[2])
    return make_entry(seed, index, draw(seed, index + 1)[index])


def _default() -> None:
    for i, spec in enumerate(draw(GENERATED_SEED, GENERATED)):
        register(make_entry(GENERATED_SEED, i, spec))


_default()
