"""Parallel configurations and training settings, with validation that names the broken rule.

Two meshes share one world (Megatron-Core's MoE parallel folding): attention layers use
``tp x cp x dp x pp`` and expert layers ``etp x ep x edp x pp`` with ``edp = world / (etp ep pp)``.
``order`` lists the axes innermost first (contiguous ranks). Two mappings of the expert mesh:

* ``folded`` (Megatron-Core's expert rank generator): the expert axes take the places of their
  attention counterparts in ``order`` (tp -> etp, ep -> ep, dp -> edp; cp folds into edp), so
  with ``etp=1`` an expert-parallel group may cover ranks attention uses for tp, cp and dp;
  ``etp`` is independent of ``tp``.
* ``unfolded`` (the classic layout before folding): experts reuse the attention mesh, ``etp ==
  tp`` and ``ep`` splits dp (``ep`` must sit next to ``dp`` in ``order``; the inner factor of the
  pair is contiguous); ``edp = cp x dp / ep``.

With ``cp == 1`` and ``ep`` right inside ``dp`` both mappings place every rank alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshfold.sim.context_attention import METHODS
from meshfold.sim.model import ModelSpec
from meshfold.target.hardware import DTYPE_BYTES, Cluster

RECOMPUTE = ("none", "selective", "full")
AXES = ("tp", "cp", "ep", "dp", "pp")
MOE_MAPPINGS = ("folded", "unfolded")
SCHEDULES = ("1f1b", "zb-h1")
"""Pipeline schedules: ``1f1b`` (interleaved when ``vpp`` > 1) and ``zb-h1`` (Qi et al. 2023, "Zero
Bubble Pipeline Parallelism": the weight-gradient GEMMs of the cool-down fill the bubble; vpp 1)."""
STAGE_SPLITS = ("balanced", "even", "edges")
"""Which layers each stage holds: ``balanced`` is ``passes.stages.split_layers`` on the simulator's
layer, embedding and head times (the rule the pipeline runtime uses); ``even`` equal layer counts
(Megatron-LM's default, one more on later stages where they do not divide); ``edges`` equal counts
with the embedding and the LM head each taking one layer's place (Llama 3 405B's pipeline: one
layer fewer on the first and the last stage; at one layer a chunk the first chunk holds only the
embedding and the last only the output layer and the loss, "The Llama 3 Herd of Models" sec. 3.3.2),
so ``pp * vpp`` may be up to two more than the layers."""


class ConfigError(ValueError):
    """A parallel configuration that cannot run; the message names the violated constraint."""


@dataclass(frozen=True, slots=True)
class TrainSpec:
    """What one optimizer step trains: ``global_batch`` sequences of ``seq_len`` tokens in ``dtype``.

    ``grad_dtype`` is the gradient accumulation and reduction type (Megatron keeps fp32
    ``main_grad``). ``causal`` is the mask the kernels execute; ``mfu_causal`` whether MFU counts
    only the unmasked half of attention (Megatron-LM counts the full square: False).
    ``flash_attention`` selects fused attention (no score matrix in memory)."""

    seq_len: int
    global_batch: int
    dtype: str = "bf16"
    optimizer: str = "adam"
    grad_dtype: str = "fp32"
    flash_attention: bool = True
    causal: bool = True
    mfu_causal: bool = False

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.global_batch < 1:
            raise ConfigError(f"seq_len and global_batch must be >= 1, got {self.seq_len}, {self.global_batch}")
        for field in ("dtype", "grad_dtype"):
            if getattr(self, field) not in DTYPE_BYTES:
                raise ConfigError(f"{field} {getattr(self, field)!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.optimizer not in ("adam", "sgd"):
            raise ConfigError(f"optimizer {self.optimizer!r} is not supported; use adam or sgd")

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.seq_len * self.global_batch

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element (fp8 GEMMs keep bf16 activations)."""
        return 2 if DTYPE_BYTES[self.dtype] <= 2 else 4

    @property
    def weight_bytes(self) -> int:
        """Bytes per model weight as the GEMMs read it (fp8 recipes keep bf16 weights)."""
        return DTYPE_BYTES[self.dtype] if self.dtype != "fp8" else 2

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element (accumulation and reduction)."""
        return DTYPE_BYTES[self.grad_dtype]


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """One way to run a step. ``zero``: 0 = replicated DDP, 1 = distributed optimizer (optimizer
    state sharded over dp x cp), 2 = + gradients sharded, 3 = FSDP (parameters sharded too).
    ``etp=None`` means expert TP = ``tp``; ``sequence_parallel=None`` means on whenever tp > 1.
    ``vpp`` > 1 selects the interleaved 1F1B schedule with that many model chunks per stage.
    ``tp_comm_overlap`` pipelines TP collectives with their GEMMs (Transformer Engine userbuffers);
    ``dp_overlap`` overlaps gradient reduce-scatter / parameter all-gather with compute by buckets.
    ``moe_mapping`` selects how the expert mesh sits on the ranks (module docstring).
    ``schedule`` and ``stage_split`` choose the pipeline schedule and the layers of each stage
    (``SCHEDULES``, ``STAGE_SPLITS``); any layer count over any ``pp * vpp`` chunks runs."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    micro_batch_size: int = 1
    zero: int = 1
    sequence_parallel: bool | None = None
    recompute: str = "none"
    tp_comm_overlap: bool = False
    dp_overlap: bool = True
    order: str = "tp-cp-ep-dp-pp"
    moe_mapping: str = "folded"
    cp_method: str = "ring"
    """How attention reads the ``cp`` split: ``ring``, ``tokenring``, ``ulysses`` or ``allgather``
    (``context_attention``)."""
    schedule: str = "1f1b"
    stage_split: str = "balanced"

    @property
    def world(self) -> int:
        """Devices the attention mesh covers: dp * tp * cp * pp."""
        return self.dp * self.tp * self.cp * self.pp

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (norms and dropout on 1/tp of the tokens)."""
        return self.tp > 1 and (self.sequence_parallel is None or self.sequence_parallel)

    @property
    def etp_size(self) -> int:
        """Expert tensor-parallel size in effect."""
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world / (etp * ep * pp)."""
        return self.world // (self.etp_size * self.ep * self.pp)

    @property
    def folded(self) -> bool:
        """True for the folded expert mapping."""
        return self.moe_mapping != "unfolded"

    @property
    def fsdp(self) -> bool:
        """True for ZeRO-3 (parameters sharded over dp x cp)."""
        return self.zero == 3

    @property
    def distributed_optimizer(self) -> bool:
        """True when optimizer state is sharded (ZeRO >= 1)."""
        return self.zero >= 1

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule in words: ``none``, ``1F1B``, ``interleaved 1F1B (vpp 4)`` or ``ZB-H1``."""
        if self.pp == 1:
            return "none"
        if self.schedule == "zb-h1":
            return "ZB-H1"
        return f"interleaved 1F1B (vpp {self.vpp})" if self.vpp > 1 else "1F1B"

    def num_microbatches(self, train: TrainSpec) -> int:
        """Micro-batches per step on each data-parallel rank: global_batch / (dp * micro_batch_size)."""
        return train.global_batch // (self.dp * self.micro_batch_size)

    def attention_axes(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the attention mesh, innermost first."""
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        return tuple((a, sizes[a]) for a in self.order.split("-") if a in sizes)

    def expert_axes(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the expert mesh, innermost first: etp, ep and edp (and cp, which the
        unfolded mapping keeps as a part of edp) and pp."""
        axes = {"tp": ("etp", self.etp_size), "ep": ("ep", self.ep), "pp": ("pp", self.pp)}
        if self.folded:
            axes["dp"] = ("edp", self.edp)  # NOTE: cp has no place of its own: it folds into edp
        else:
            axes |= {"cp": ("cp", self.cp), "dp": ("edp", self.dp // self.ep)}
        return tuple(axes[a] for a in self.order.split("-") if a in axes)

    def edp_axes(self) -> tuple[str, ...]:
        """Names of the expert mesh axes that together form the expert data-parallel group."""
        return ("edp",) if self.folded else ("cp", "edp")

    def describe(self) -> str:
        """Short deterministic text, e.g. ``dp48 tp8 pp2 vpp21 mbs1 zero1 sp``."""
        parts = [f"dp{self.dp}", f"tp{self.tp}"]
        parts += [f"{n}{v}" for n, v in (("cp", self.cp), ("pp", self.pp), ("vpp", self.vpp), ("ep", self.ep)) if v > 1]
        if self.pp > 1 and self.schedule != "1f1b":
            parts.append(self.schedule)
        if self.pp > 1 and self.stage_split != "balanced":
            parts.append(f"{self.stage_split}-split")
        if self.cp > 1 and self.cp_method != "ring":
            parts.append(self.cp_method)
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        if not self.folded:
            parts.append("unfolded")
        parts += [f"mbs{self.micro_batch_size}", "fsdp" if self.fsdp else f"zero{self.zero}"]
        if self.sp:
            parts.append("sp")
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.tp_comm_overlap and self.tp > 1:
            parts.append("tp-overlap")
        return " ".join(parts)

    def validate(self, model: ModelSpec, cluster: Cluster, train: TrainSpec) -> None:
        """Raise ConfigError naming the first violated constraint; return None when runnable."""
        for name in ("dp", "tp", "pp", "cp", "ep", "vpp", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and self.etp < 1:
            raise ConfigError(f"etp must be >= 1, got {self.etp}")
        if sorted(self.order.split("-")) != sorted(AXES):
            raise ConfigError(f"order {self.order!r} must list each of {'-'.join(AXES)} once")
        if self.world != cluster.world_size:
            raise ConfigError(
                f"tp*cp*dp*pp == world violated: {self.tp}*{self.cp}*{self.dp}*{self.pp} = {self.world}, "
                f"but {cluster} has {cluster.world_size} devices"
            )
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute {self.recompute!r} must be one of {', '.join(RECOMPUTE)}")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        if model.heads % self.tp:
            raise ConfigError(f"heads % tp == 0 violated: {model.heads} heads over tp={self.tp}")
        if not model.is_mla and model.n_kv_heads % self.tp:
            raise ConfigError(f"kv_heads % tp == 0 violated: {model.n_kv_heads} kv heads over tp={self.tp}")
        if model.ffn_hidden % self.tp:
            raise ConfigError(f"ffn_hidden % tp == 0 violated: {model.ffn_hidden} over tp={self.tp}")
        slots = model.layers + (2 if self.stage_split == "edges" and self.pp > 1 else 0)
        if slots < self.pp * self.vpp:
            held = "a layer, the embedding or the head" if slots > model.layers else "at least one layer"
            raise ConfigError(
                f"layers >= pp*vpp violated: {model.layers} layers cannot fill pp={self.pp} x vpp={self.vpp} = "
                f"{self.pp * self.vpp} pipeline chunks (each holds {held}); use fewer stages or virtual stages"
            )
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("vpp > 1 needs pp > 1 (interleaved 1F1B interleaves pipeline stages)")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule {self.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if self.schedule == "zb-h1" and self.vpp > 1:
            raise ConfigError(
                f"schedule zb-h1 runs one chunk per stage, got vpp={self.vpp}; use vpp=1 or schedule=1f1b (interleaved)"
            )
        if self.stage_split not in STAGE_SPLITS:
            raise ConfigError(f"stage_split {self.stage_split!r} must be one of {', '.join(STAGE_SPLITS)}")
        if train.global_batch % (self.dp * self.micro_batch_size):
            raise ConfigError(
                f"global_batch % (dp*micro_batch_size) == 0 violated: {train.global_batch} sequences "
                f"over dp={self.dp} x mbs={self.micro_batch_size}"
            )
        m = self.num_microbatches(train)
        if self.vpp > 1 and m % self.pp:
            raise ConfigError(
                f"num_microbatches % pp == 0 violated for the interleaved schedule: {m} micro-batches, pp={self.pp}"
            )
        if self.cp_method not in METHODS:
            raise ConfigError(f"cp_method {self.cp_method!r} must be one of {', '.join(METHODS)}")
        if self.cp > 1 and self.cp_method == "ulysses" and model.heads % (self.tp * self.cp):
            raise ConfigError(
                f"heads % (tp*cp) == 0 violated: {model.heads} heads over tp={self.tp} x cp={self.cp} (Ulysses "
                "splits the heads over cp)"
            )
        if self.cp > 1 and train.seq_len % (2 * self.cp):
            raise ConfigError(
                f"seq_len % (2*cp) == 0 violated: seq {train.seq_len}, cp={self.cp} (load-balanced ring attention)"
            )
        if train.dtype not in cluster.device.dtypes:
            raise ConfigError(
                f"dtype {train.dtype!r} has no peak on {cluster.device.name}; "
                f"it supports {', '.join(cluster.device.dtypes)}"
            )
        self._validate_experts(model)

    def _validate_experts(self, model: ModelSpec) -> None:
        """Megatron-Core's expert-mesh rules (MoE parallel folding), first violation raised."""
        if self.moe_mapping not in MOE_MAPPINGS:
            raise ConfigError(f"moe_mapping {self.moe_mapping!r} must be one of {', '.join(MOE_MAPPINGS)}")
        if not model.num_experts:
            if self.ep > 1:
                raise ConfigError(f"ep={self.ep} needs a model with experts; {model.name} is dense")
            return
        if model.num_experts % self.ep:
            raise ConfigError(f"num_experts % ep == 0 violated: {model.num_experts} experts over ep={self.ep}")
        if model.moe_ffn_hidden % self.etp_size:
            raise ConfigError(f"moe_ffn_hidden % etp == 0 violated: {model.moe_ffn_hidden} over etp={self.etp_size}")
        expert_world = self.etp_size * self.ep * self.pp
        if self.world % expert_world:
            raise ConfigError(
                f"etp*ep*edp*pp == world violated: etp*ep*pp = {expert_world} does not divide world {self.world}"
            )
        if not self.folded:
            self._validate_unfolded()
        if self.tp > 1 and not self.sp:
            raise ConfigError("MoE with tp > 1 requires sequence_parallel (Megatron-Core rule)")

    def _validate_unfolded(self) -> None:
        """The classic expert layout: experts inside the attention mesh's dp x tp ranks."""
        if self.etp_size != self.tp:
            raise ConfigError(
                f"etp == tp violated: the unfolded mapping shares the attention tp group, got etp={self.etp_size}, "
                f"tp={self.tp}; use moe_mapping='folded' for an independent etp"
            )
        if self.dp % self.ep:
            raise ConfigError(
                f"dp % ep == 0 violated: the unfolded mapping nests ep={self.ep} inside dp={self.dp}; "
                "use moe_mapping='folded' to let ep span tp/cp ranks"
            )
        if "ep-dp" not in self.order and "dp-ep" not in self.order:
            raise ConfigError(f"ep next to dp in order violated: the unfolded mapping splits dp, got {self.order!r}")


def divisors(n: int) -> list[int]:
    """Sorted positive divisors of ``n``."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
