"""The corpus's generated models (``meshfold.tools.corpus.grammar``): the draw is deterministic and
covers the grammar, and every default entry builds the same twice and trains on one device."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from meshfold.tools.corpus import entries as corpus_entries
from meshfold.tools.corpus.entries import grammar
from meshfold.tools.corpus.entries.grammar import CHOICES, GENERATED, GENERATED_SEED, ModelSpec, draw

DEFAULT = [f"gen-{GENERATED_SEED}-{i}" for i in range(GENERATED)]
SHOW = "from meshfold.tools.corpus.entries.grammar import draw; print(repr(draw(0, 10)), repr(draw(5, 12)))"


def test_draw_is_the_same_in_another_process() -> None:
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", SHOW], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == f"{draw(0, 10)!r} {draw(5, 12)!r}"


def test_draw_is_the_same_when_drawn_again() -> None:
    first = draw(7, 12)
    grammar._stream.cache_clear()
    grammar._covered.cache_clear()
    assert draw(7, 12) == first


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_draws_are_distinct_prefixes(seed: int) -> None:
    specs = draw(seed, 30)
    assert len(set(specs)) == 30
    assert all(draw(seed, m) == specs[:m] for m in (1, 5, 8, 10))


def test_default_set_covers_every_choice() -> None:
    assert grammar.missing(draw(GENERATED_SEED, GENERATED)) == []
    assert all(grammar.missing(draw(seed, 8)) == [] for seed in range(1, 6))


def test_cover_fills_what_the_draw_missed() -> None:
    base = ModelSpec()
    near = [base, *(replace(base, **{f: CHOICES[f][1]}) for f in ("bias", "tied", "layers", "dropout", "qk_norm"))]
    near += [replace(base, window=8), replace(base, norm="layernorm")]
    covered = grammar.cover(near)
    assert grammar.missing(covered) == [] and len(set(covered)) == len(near)


def test_spec_is_validated_and_picklable() -> None:
    spec = draw(0, 2)[1]
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(ValueError):
        ModelSpec(position="learned", rotary=0.5)
    with pytest.raises(ValueError):
        ModelSpec(mlp="gelu", dispatch="where-eq")


def test_entries_are_named_and_rebuilt_from_their_names() -> None:
    listed = {e.name for e in corpus_entries.entries() if e.kind == "generated"}
    assert set(DEFAULT) <= listed
    for i, name in enumerate(DEFAULT):
        entry, spec = corpus_entries.get(name), draw(GENERATED_SEED, GENERATED)[i]
        assert (entry.kind, entry.source, entry.traits) == ("generated", "generated", spec.traits)
        assert entry.note == str(spec)
        assert grammar.entry_named(name).note == entry.note
    assert corpus_entries.get("gen-3-11").note == str(draw(3, 12)[11])
    with pytest.raises(ValueError):
        grammar.entry_named("gen-x-1")


@pytest.mark.parametrize("name", DEFAULT)
def test_default_entry_builds_alike_and_trains(name: str) -> None:
    entry = corpus_entries.get(name)
    model, inputs = entry.build()
    again, inputs_again = entry.build()
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all(torch.equal(a, b) for a, b in zip(inputs, inputs_again, strict=True))
    loss = entry.loss(model(*inputs))
    assert loss.dim() == 0 and math.isfinite(float(loss.detach()))
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
