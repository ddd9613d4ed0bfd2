"""Finding MoE layers in unmodified models at capture time.

Detection walks the module tree before capture. An experts module in the transformers style (one
``[E, 2I, H]`` gate/up weight and one ``[E, H, I]`` down weight, called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``) is captured as the single op
``meshfold.moe_experts`` (``ir.dialects.moe``), whatever kernel it would have run (eager loop, batched or
grouped GEMM): its routing stays ordinary ops, its experts become one op the sharding pass can
split by expert. MoE code written against ``ir.dialects.moe.experts`` (exported as
``meshfold.moe_experts``) arrives as that op already. An MoE layer whose experts are anything else
(biases, a layout we do not know) is left as it is: its experts stay replicated, and a warning
names the layer. Experts held in an ``nn.ModuleList`` are folded on dynamo's graph instead
(``meshfold.rewrites.moe_lists``).

The expert mapping a user asks for with ``moe=`` (``MoeSpec``) and the ``moe-fold`` pass that
applies it live in ``meshfold.passes.moe``.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from meshfold.ir.dialects.moe import ACTIVATIONS, experts
from meshfold.passes.moe.spec import ExpertsSite, MoeSpec

# NOTE: transformers' hidden_act names for the activations ir.dialects.moe implements.
_HF_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_HF_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}


def find_experts(model: nn.Module) -> tuple[list[ExpertsSite], list[str]]:
    """The experts modules meshfold folds, and a warning per MoE layer it leaves replicated."""
    sites: list[ExpertsSite] = []
    notes: list[str] = []
    for path, mod in model.named_modules():
        site, why = _as_site(path, mod)
        if site is not None:
            sites.append(site)
        elif why:
            notes.append(why)
    return sites, notes


def _as_site(path: str, mod: nn.Module) -> tuple[ExpertsSite | None, str]:
    gate_up, down = mod._parameters.get("gate_up_proj"), mod._parameters.get("down_proj")
    where = f"MoE layer {path or '<root>'} ({type(mod).__name__})"
    if gate_up is not None and down is not None and gate_up.dim() == 3 and down.dim() == 3:
        flags = {k: getattr(mod, k, v) for k, v in _HF_FLAGS.items()}
        wrong = [k for k, v in _HF_FLAGS.items() if flags[k] != v] + (
            ["has_post_expert_norm"] if getattr(mod, "has_post_expert_norm", False) else []
        )
        hidden_act = getattr(getattr(mod, "config", None), "hidden_act", None)
        act = _HF_ACTS.get(str(hidden_act)) if hidden_act is not None else _act_of(getattr(mod, "act_fn", None))
        shapes_ok = gate_up.shape[0] == down.shape[0] and gate_up.shape[1] == 2 * down.shape[2]
        if wrong or act is None or not shapes_ok:
            reason = f"unsupported experts layout ({', '.join(wrong)})" if wrong else "an unknown activation or shape"
            return None, f"{where}: {reason}; its experts stay replicated"
        prefix = f"{path}." if path else ""
        site = ExpertsSite(
            path, prefix + "gate_up_proj", prefix + "down_proj", act, int(gate_up.shape[0]), int(down.shape[2])
        )
        return site, ""
    # NOTE: experts in an nn.ModuleList are folded (or warned about) on the captured graph: meshfold.rewrites.moe_lists.
    return None, ""


def _act_of(fn: object) -> str | None:
    """Which of ``ir.dialects.moe``'s activations the callable ``fn`` computes (checked on sample values), for
    experts modules that name none in their config (transformers' LFM2-MoE hard-codes ``F.silu``)."""
    if not callable(fn):
        return None
    x = torch.linspace(-4.0, 4.0, 33)
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    return next((name for name, f in ACTIVATIONS.items() if torch.allclose(y, f(x), rtol=1e-5, atol=1e-6)), None)


@contextlib.contextmanager
def experts_as_ops(model: nn.Module, spec: MoeSpec | None = None) -> Iterator[list[ExpertsSite]]:
    """For the duration of a capture, every recognized experts module runs ``meshfold.moe_experts``
    (with ``spec``'s capacity, drop policy and dispatcher); warnings name the MoE layers left as
    they are. The model is restored afterwards. Without ``spec``: dropless, any dispatcher."""
    options = op_options(spec)
    sites, notes = find_experts(model)
    for note in notes:
        warnings.warn(note, stacklevel=3)
    modules = dict(model.named_modules())
    patched: list[nn.Module] = []
    try:
        for site in sites:
            mod = modules[site.path]
            mod.forward = types.MethodType(_folded_forward(site.act, *options), mod)  # type: ignore[method-assign]
            patched.append(mod)
        yield sites
    finally:
        for mod in patched:
            del mod.forward


def op_options(spec: MoeSpec | None) -> tuple[str, float, str]:
    """The experts op's (dispatcher, capacity factor, drop policy) for ``spec``; without one: any
    dispatcher, dropless."""
    if spec is None:
        return ("any", 0.0, "probs")
    return ("hierarchical" if spec.hierarchical else spec.dispatcher, spec.capacity_factor or 0.0, spec.policy)


def _folded_forward(act: str, dispatcher: str, capacity_factor: float, policy: str) -> Any:
    def forward(
        self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return experts(
            hidden,
            top_k_index,
            top_k_weights,
            self.gate_up_proj,  # type: ignore[arg-type]
            self.down_proj,  # type: ignore[arg-type]
            act,
            capacity_factor,
            policy,
            dispatcher,
        )

    return forward


__all__ = ["ExpertsSite", "MoeSpec", "experts_as_ops", "find_experts", "op_options"]
