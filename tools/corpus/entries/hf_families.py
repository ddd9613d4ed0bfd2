"""Corpus entries from ``transformers``: each family's own model class, built from its config class
small (64 wide, 4 layers, a vocabulary of 256) with seeded random weights, trained on 8 sequences of
16 tokens (or 8 images of 32 x 32 pixels). The model code is transformers'; only the sizes are ours.

An entry names its config and model classes and a task (``CAUSAL``, ``MASKED``, ``SEQ2SEQ``, ``IMAGE``
or ``MOE``: what the model is trained on and what a config of that task is given); the fields it
passes besides select the family's variant. Every dropout is off, and a special token id beyond our
vocabulary is moved into it (``_small_config``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshfold.tools.corpus.catalog import Built, Entry, register, seeded, tokens
from meshfold.tools.zoo.hf_zoo import _hf_loss_cls

VOCAB = 256
LABELS = 10
"""The vocabulary of every token model here, and the classes of every image model."""
LM = frozenset({"attention", "stack", "deep", "tokens"})
"""What a transformer of this module has: attention over its tokens, and a stack of four layers."""
SCAN = frozenset({"stack", "deep", "tokens"})
"""What a state-space model without softmax attention has."""
CNN = frozenset({"stack", "deep", "running-stats"})
"""What a convolutional network of this module has: four stages (or more blocks), BatchNorm."""

SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
"""The sizes every token model here shares, under their usual names (the config's ``attribute_map``
translates a family's own names; a size its config has no attribute for is left out)."""
ENCODER_DECODER: dict[str, Any] = {
    "encoder_layers": 4,
    "decoder_layers": 4,
    "num_decoder_layers": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "d_kv": 16,
    "decoder_vocab_size": VOCAB,
}
"""``SMALL`` under the names BART's and T5's families give their decoder's (and encoder's) sizes."""
EXPERTS: dict[str, Any] = {
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "output_router_logits": False,
}
"""Four routed experts, top-2, half as wide as the dense MLP (where the family sizes them apart), no
auxiliary loss: a load-balancing loss is a product of batch means, which no split of the batch (data
parallel ranks, pipeline microbatches) reproduces."""


def _token_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's token ids, as the inputs and as the labels (every label counted)."""
    ids = tokens(VOCAB)
    return ids, ids.clone()


def _translation() -> tuple[torch.Tensor, torch.Tensor]:
    """Source ids and (other) target ids; the decoder's inputs are the targets shifted right."""
    return tokens(VOCAB), tokens(VOCAB, seed=1)


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    """``[8, 3, 32, 32]`` pixels and 8 class labels, from a seeded generator."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, LABELS, (8,), generator=g)


@functools.cache
def _loss_cls(base: type[nn.Module], key: str, extra: tuple[tuple[str, Any], ...] = ()) -> type[nn.Module]:
    """Subclass an HF model so ``forward(inputs, labels)`` passes ``inputs`` as ``key`` (and ``extra``)
    and returns the loss of the output, keeping HF's FQNs."""

    class HFLoss(base):  # type: ignore[misc, valid-type]
        """HF model returning only its training loss."""

        def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return super().forward(**{key: inputs}, labels=labels, **dict(extra)).loss

    HFLoss.__name__ = HFLoss.__qualname__ = f"{base.__name__}Loss"
    return HFLoss


@dataclass(frozen=True)
class Task:
    """What one kind of HF model is trained on here: ``wrap`` makes its class return the loss on
    ``example()``; ``sizes`` what its config is given; ``traits`` the entries' default;
    ``experts`` the experts implementation of a mixture of experts (HF's default, ``grouped_mm``,
    offsets its matmuls by counts the routing decides; ``batched_mm`` gathers each token's experts)."""

    wrap: Callable[[type[nn.Module]], type[nn.Module]]
    example: Callable[[], tuple[torch.Tensor, ...]]
    sizes: dict[str, Any]
    traits: frozenset[str]
    experts: str | None = None
    kind: str = "decoder"


CAUSAL = Task(_hf_loss_cls, _token_pair, SMALL, LM)
MASKED = Task(functools.partial(_loss_cls, key="input_ids"), _token_pair, SMALL, LM, kind="encoder")
SEQ2SEQ = Task(
    functools.partial(_loss_cls, key="input_ids", extra=(("use_cache", False),)),
    _translation,
    SMALL | ENCODER_DECODER,
    LM,
    kind="encoder-decoder",
)
IMAGE = Task(functools.partial(_loss_cls, key="pixel_values"), _images, {"num_labels": LABELS}, CNN, kind="cnn")
MOE = Task(_hf_loss_cls, _token_pair, SMALL | EXPERTS, LM | {"moe"}, "batched_mm", kind="moe")


def _small_config(name: str, sizes: dict[str, Any], fields: dict[str, Any]) -> Any:
    """transformers' config class ``name`` on ``fields`` (one set to None is left out) and those of
    ``sizes`` it has an attribute for and ``fields`` does not name (under any alias), with every
    dropout rate 0 and every special token id below ``VOCAB`` (a real tokenizer's id would fall
    outside the embedding: it becomes 0)."""
    import transformers

    cls = getattr(transformers, name)
    default, alias = cls(), cls.attribute_map
    named = {alias.get(k, k) for k in fields}
    given = {k: v for k, v in sizes.items() if hasattr(default, k) and alias.get(k, k) not in named} | fields
    cfg = cls(**{k: v for k, v in given.items() if v is not None})
    for attr, value in list(vars(cfg).items()):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if any(word in attr for word in ("dropout", "pdrop", "layerdrop", "drop_path")):
            setattr(cfg, attr, 0.0)
        elif attr.endswith("_token_id") and value >= VOCAB:
            setattr(cfg, attr, 0)
    return cfg


def hf_builder(task: Task, config: str, model: str, fields: dict[str, Any]) -> Callable[[], Built]:
    """A builder of transformers' ``model`` on its config ``config`` (``_small_config``) with seeded
    weights, returning its loss on ``task.example()``. Attention is ``sdpa`` where the family supports
    it, else ``eager``."""

    def build() -> Built:
        import transformers

        base = getattr(transformers, model)
        cfg = _small_config(config, task.sizes, fields)
        cfg._attn_implementation = "sdpa" if base._supports_sdpa else "eager"
        if task.experts:
            cfg._experts_implementation = task.experts
        cls = task.wrap(base)
        return seeded(lambda: cls(cfg)), task.example()

    return build


def _hf(
    task: Task,
    name: str,
    config: str,
    model: str,
    note: str,
    *,
    kind: str | None = None,
    traits: frozenset[str] | None = None,
    **fields: Any,
) -> Entry:
    """Register transformers' ``model`` on its ``config`` trained for ``task`` (``hf_builder``);
    ``kind`` and ``traits`` default to the task's."""
    build = hf_builder(task, config, model, fields)
    return register(
        Entry(
            name,
            kind or task.kind,
            f"transformers.{model}",
            build,
            task.traits if traits is None else traits,
            ("transformers",),
            note=note,
        )
    )


decoder = functools.partial(_hf, CAUSAL)
encoder = functools.partial(_hf, MASKED)
seq2seq = functools.partial(_hf, SEQ2SEQ)
cnn = functools.partial(_hf, IMAGE)
moe = functools.partial(_hf, MOE)
"""``_hf`` for one task: ``decoder(name, config, model, note, **fields)`` registers an entry (the
families are in ``hf_decoders`` and ``hf_others``)."""
