"""torchtitan's Llama recipe on the benches' Llama-style model, as DTensor eager: tensor and sequence
parallel over ``tp`` and FSDP2 with explicit prefetch over ``dp``.

torchtitan's own functions cannot run here (its Llama code imports triton, absent on CPU; its TP is
declared in its model classes' sharding configs): these are the torch.distributed calls it makes.
"""

from __future__ import annotations

import itertools
from typing import Any

from torch import nn

from meshfold.tools.bench.eager_vs_dtensor import BenchLlama


def titan_model(model: BenchLlama, mesh: Any, mp_policy: Any = None) -> nn.Module:
    """torchtitan's Llama TP + sequence parallel over ``tp`` and FSDP2 with explicit prefetch over ``dp``
    (the logits stay a vocab-sharded DTensor: run the loss under ``loss_parallel``); ``mp_policy``: its
    mixed-precision settings as FSDP2's ``MixedPrecisionPolicy`` (torchtitan's default: bf16
    parameters, fp32 reduction)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp, dp = mesh["tp"], mesh["dp"]
    root = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, tp, root)  # type: ignore[arg-type]
    layers = list(model.layers)
    for layer in layers:
        plan: dict[str, Any] = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
        plan |= {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(layer, tp, plan)
    # NOTE: FSDP's default gradient averaging over dp stands in for torchtitan's sum divided by the
    # global token count (the same gradients for equal per-rank token counts).
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    fully_shard(model.embed_tokens, mesh=dp, **policy)
    fully_shard([model.norm, model.lm_head], mesh=dp, reshard_after_forward=False, **policy)
    for layer in layers:
        fully_shard(layer, mesh=dp, **policy)
    fully_shard(model, mesh=dp, **policy)
    forward = [model.embed_tokens, *layers]
    for unit, nxt in itertools.pairwise(forward):
        unit.set_modules_to_forward_prefetch([nxt])  # type: ignore[operator]
    layers[-1].set_modules_to_forward_prefetch([model.norm, model.lm_head])  # type: ignore[operator]
    backward = [model.lm_head, *reversed(layers), model.embed_tokens]
    for unit, nxt in itertools.pairwise(backward):
        unit.set_modules_to_backward_prefetch([nxt])  # type: ignore[operator]
    return model
