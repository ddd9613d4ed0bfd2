"""Which layers each pipeline stage holds, as the simulator prices it.

``passes.stages.split_layers`` is the one rule (the pipeline runtime splits by it too); this module
feeds it the simulator's own figures: each layer's forward + backward time for one micro-batch
(dense and MoE layers cost differently, so DeepSeek-V3's three dense first layers weigh less than
its MoE ones), the embedding's time as ``head`` and the final norm, LM head and loss as ``tail``,
and ``fits`` from the footprint under the schedule (1F1B rank ``r`` keeps ``min(pp - r, m)``
micro-batches in flight, so early stages can hold fewer layers than late ones).

With virtual stages the split is over ``pp x vpp`` chunks, chunk ``c`` on pipeline rank ``c % pp``
(Megatron's interleaved order); a rank's time and memory are the sums over its chunks. The
``edges`` split is the even split of ``layers + 2`` places, the first the embedding's and the last
the head's, so a chunk may hold no layer at all (only an edge). When no
split fits memory the split that ignores memory is kept (the simulation then reports a peak over
the device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshfold.passes.stages import Fits, SplitError, StageSplit, even_split, split_layers, stage_sums
from meshfold.sim.footprint import StageLayers, StageMemory
from meshfold.sim.model import ModelSpec
from meshfold.sim.parallel import ParallelConfig


@dataclass(frozen=True, slots=True)
class PipelineStages:
    """The split of ``model``'s layers over ``pp x vpp`` chunks and what each pipeline rank holds."""

    split: StageSplit
    ranks: tuple[StageLayers, ...]
    pp: int

    def chunk_bounds(self, rank: int) -> tuple[tuple[int, int], ...]:
        """(first layer, end) of each virtual chunk of ``rank``, in chunk order."""
        b = self.split.bounds
        return tuple((b[c], b[c + 1]) for c in range(rank, len(b) - 1, self.pp))

    @property
    def counts(self) -> tuple[int, ...]:
        """Layers on each pipeline rank (all its chunks)."""
        return tuple(r.layers for r in self.ranks)


def layer_kind(model: ModelSpec, layer: int) -> str:
    """ "dense" or "moe": the first ``model.dense_layers`` layers are dense, the rest MoE."""
    return "dense" if layer < model.dense_layers else "moe"


def _kinds_in(model: ModelSpec, first: int, end: int) -> tuple[int, int]:
    """(dense, moe) layers among ``first..end-1``."""
    dense = max(0, min(end, model.dense_layers) - first)
    return dense, end - first - dense


def plan_stages(
    model: ModelSpec,
    cfg: ParallelConfig,
    times: dict[str, float],
    head: float,
    tail: float,
    memory: StageMemory,
    hbm: float,
) -> PipelineStages:
    """The stages of ``cfg`` for layers whose kinds take ``times`` seconds each (forward + backward
    of one micro-batch), an embedding of ``head`` and a loss side of ``tail`` seconds, on devices
    of ``hbm`` bytes (module docstring). ``cfg.stage_split`` ``even`` takes equal layer counts,
    ``edges`` equal counts of layers and edges (``parallel.STAGE_SPLITS``)."""
    n, pp, chunks = model.layers, cfg.pp, cfg.pp * cfg.vpp
    per_layer = [times[layer_kind(model, i)] for i in range(n)]
    if chunks == 1:
        split = StageSplit((0, n), (sum(per_layer) + head + tail,))
    elif cfg.stage_split == "even":
        bounds = even_split(n, chunks).bounds
        split = StageSplit(bounds, stage_sums(per_layer, bounds, head, tail))
    elif cfg.stage_split == "edges":
        # NOTE: place 0 is the embedding, places 1..n the layers, place n + 1 the head
        bounds = tuple(min(max(b - 1, 0), n) for b in even_split(n + 2, chunks).bounds)
        split = StageSplit(bounds, stage_sums(per_layer, bounds, head, tail))
    else:
        try:
            # NOTE: when even the mean rank cannot fit, or the chunks have no room for the layers,
            # no split fits: skip the constrained search (it would fail)
            if memory.floor() > hbm or _no_room(model, cfg, memory, hbm):
                raise SplitError("no split fits")
            split = split_layers(per_layer, chunks, head=head, tail=tail, fits=_fits(model, cfg, memory, hbm))
        except SplitError:
            split = split_layers(per_layer, chunks, head=head, tail=tail)
    ranks = []
    for r in range(pp):
        held = tuple(_kinds_in(model, split.bounds[c], split.bounds[c + 1]) for c in range(r, chunks, pp))
        dense, moe = sum(d for d, _ in held), sum(e for _, e in held)
        ranks.append(StageLayers(r, dense, moe, r == 0, r == (chunks - 1) % pp, held))
    return PipelineStages(split, tuple(ranks), pp)


@dataclass(frozen=True, slots=True)
class _Budget:
    """What a chunk may hold (``_fits``): ``budget`` bytes a chunk, less ``emb`` on the first and
    ``tail`` on the last; ``per[rank]`` is (dense, MoE) bytes a layer on that rank (static +
    activations in flight / vpp)."""

    budget: float
    emb: float
    tail: float
    per: tuple[tuple[float, float], ...]


def _budget(model: ModelSpec, cfg: ParallelConfig, memory: StageMemory, hbm: float) -> _Budget:
    """The ``_Budget`` of ``cfg``'s chunks on devices of ``hbm`` bytes."""
    chunks, pp = cfg.pp * cfg.vpp, cfg.pp
    per = tuple((memory.chunk_need(r, 1, 0, False, False), memory.chunk_need(r, 0, 1, False, False)) for r in range(pp))
    emb = memory.chunk_need(0, 0, 0, True, False)
    tail = memory.chunk_need((chunks - 1) % pp, 0, 0, False, True)
    return _Budget((hbm - memory.fixed(0, model.moe_layers > 0)) / cfg.vpp, emb, tail, per)


def _no_room(model: ModelSpec, cfg: ParallelConfig, memory: StageMemory, hbm: float) -> bool:
    """True when ``_fits`` holds for no split: some chunk has no room for one layer of either kind
    beside its edges, or all chunks together have room for fewer MoE layers, or fewer layers, than
    the model has (each chunk counted at its rank's bytes per layer, with a margin for rounding)."""
    chunks, b = cfg.pp * cfg.vpp, _budget(model, cfg, memory, hbm)
    kinds = [k for k, n in ((0, model.dense_layers), (1, model.moe_layers)) if n]
    moe = layers = 0.0
    for c in range(chunks):
        room = b.budget - (b.emb if c == 0 else 0.0) - (b.tail if c == chunks - 1 else 0.0)
        need = b.per[c % cfg.pp]
        least = min(need[k] for k in kinds)
        if room < least:
            return True
        layers += math.floor(room / least * (1 + 1e-9)) if least > 0 else math.inf
        moe += math.floor(room / need[1] * (1 + 1e-9)) if need[1] > 0 else math.inf
    return layers < model.layers or moe < model.moe_layers


def _fits(model: ModelSpec, cfg: ParallelConfig, memory: StageMemory, hbm: float) -> Fits:
    """``fits(chunk, first, end)`` for ``split_layers``: the chunk's static bytes and its share of
    its rank's activations in flight stay within ``1 / vpp`` of what the device has left beside
    the rank's fixed bytes (exact for one chunk per rank; with several it keeps their sum within
    the device)."""
    chunks, pp, b = cfg.pp * cfg.vpp, cfg.pp, _budget(model, cfg, memory, hbm)
    per, emb, tail, budget = b.per, b.emb, b.tail, b.budget
    nd = model.dense_layers

    def fits(c: int, first: int, end: int) -> bool:
        dense = max(0, min(end, nd) - first)
        cd, cm = per[c % pp]
        need = dense * cd + (end - first - dense) * cm
        if c == 0:
            need += emb
        if c == chunks - 1:
            need += tail
        return need <= budget

    return fits
