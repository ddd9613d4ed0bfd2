"""The corpus's entries, by whose code they are: transformers' families (``hf`` and the families in
``hf_decoders`` and ``hf_others``), torchtitan's models (``titan``), scripts written the way research
code is (``scripts``), and the models drawn from the block grammar (``grammar``, their code in
``blocks``). Importing a module registers its entries (``catalog.register``); :func:`entries` and :func:`get`
import them all first."""

import functools

from meshfold.tools.corpus.catalog import _ENTRIES, KINDS, Entry, _installed


def entries() -> list[Entry]:
    """Every entry, by kind (``KINDS``' order), then by name."""
    _load()
    return sorted(_ENTRIES.values(), key=lambda e: (KINDS.index(e.kind), e.name))


def get(name: str) -> Entry:
    """The entry named ``name``; a generated one (``gen-<seed>-<i>``) is drawn on demand."""
    _load()
    if name not in _ENTRIES and name.startswith("gen-"):
        from meshfold.tools.corpus.entries.grammar import entry_named

        return entry_named(name)
    try:
        return _ENTRIES[name]
    except KeyError:
        known = ", ".join(e.name for e in entries())
        raise ValueError(f"unknown corpus entry {name!r}; known: {known}") from None


@functools.cache
def _load() -> None:
    # NOTE: the modules register their entries as they are imported; the generated ones are drawn by
    # hypothesis (the dev extra), which a corpus run without it does without
    from meshfold.tools.corpus.entries import hf_decoders, hf_others, scripts, titan  # noqa: F401

    if _installed("hypothesis"):
        from meshfold.tools.corpus.entries import grammar  # noqa: F401
