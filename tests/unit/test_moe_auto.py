"""plan='auto' chooses the expert mapping: on H100s a Mixtral-shaped layer's experts are split by
expert (each device computes only the tokens routed to its own experts)."""

from __future__ import annotations

import warnings

import pytest
import torch

from meshfold import Options, capture, compile_model, ir
from meshfold.ir.dialects.moe import EXPERTS, EXPERTS_BACKWARD
from meshfold.passes.sharding.opwork import op_flops


@pytest.mark.hf
def test_auto_plan_splits_experts_by_expert() -> None:
    pytest.importorskip("transformers")
    from transformers import MixtralConfig, MixtralForCausalLM

    from meshfold.tools.zoo.hf_zoo import _hf_loss_cls

    config = MixtralConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = _hf_loss_cls(MixtralForCausalLM)(config)
    ids = torch.zeros(8, 256, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = capture(model, (ids, ids))
    experts = [op for op in g.ops if op.target in (EXPERTS, EXPERTS_BACKWARD)]
    # NOTE: 2048 tokens x top-2 x three 512x1024 GEMMs, twice that backward
    assert [op_flops(op) for op in experts] == [6.0 * 2048 * 2 * 512 * 1024, 12.0 * 2048 * 2 * 512 * 1024]
    pipeline = "cleanup,sharding,boxing,verify"
    out = compile_model(g, None, Options.of(mesh="ep=8", plan="auto", cluster="h100:8x1", pipeline=pipeline)).graph
    layouts = {i.name: i.value.layout for i in out.inputs}
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        assert layouts[name].placement("ep") == ir.Shard(0), layouts[name]
