"""Analytic cost model and cluster simulator for transformer training.

``hardware`` (devices, links, clusters), ``model`` (ModelSpec, parameter and FLOP counts),
``opcost`` (roofline kernel times), ``comm`` (collective times on two-level topologies),
``stagesplit`` (which layers each pipeline stage holds), ``dataparallel`` (gradient and parameter
traffic), ``simulate`` (one training step under a ParallelConfig), ``search`` (outer search over
configurations), ``calibration`` (the published runs the Hopper constants are fitted on and scored
against; scipy fits them). Everything is frozen data and pure functions; results are
deterministic. What this package exports needs no torch, so ``meshfold plan`` starts fast. The one analysis
over compiled graphs, ``passes.cost.memory`` (liveness of a rank's SPMD graph), reads ``ir``
values and is imported by name only.
"""

from meshfold.passes.cost.comm import (
    Group,
    all_gather,
    all_reduce,
    all_to_all,
    p2p,
    place_axes,
    place_axis,
    reduce_scatter,
)
from meshfold.passes.cost.footprint import layer_activation_bytes
from meshfold.passes.cost.hardware import (
    DEVICES,
    LINKS,
    Cluster,
    Device,
    Efficiency,
    Link,
    NodeGroup,
    device,
    make_cluster,
    parse_cluster,
)
from meshfold.passes.cost.model import PRESETS, Matmul, ModelSpec, from_hf_config, gpt, preset
from meshfold.passes.cost.opcost import attention_time, gemm_time, memory_time, roofline
from meshfold.passes.cost.parallel import (
    MOE_MAPPINGS,
    RECOMPUTE,
    SCHEDULES,
    STAGE_SPLITS,
    ConfigError,
    ParallelConfig,
    TrainSpec,
)
from meshfold.passes.cost.result import MemoryBreakdown, MemoryPoint, SimResult, TimelineEvent
from meshfold.passes.cost.search import Ranked, candidates, search_configs
from meshfold.passes.cost.simulate import peak_memory, simulate, stage_memories
from meshfold.passes.cost.trace import plot_memory, to_chrome_trace

__all__ = [
    "DEVICES",
    "LINKS",
    "MOE_MAPPINGS",
    "PRESETS",
    "RECOMPUTE",
    "SCHEDULES",
    "STAGE_SPLITS",
    "Cluster",
    "ConfigError",
    "Device",
    "Efficiency",
    "Group",
    "Link",
    "Matmul",
    "MemoryBreakdown",
    "MemoryPoint",
    "ModelSpec",
    "NodeGroup",
    "ParallelConfig",
    "Ranked",
    "SimResult",
    "TimelineEvent",
    "TrainSpec",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "attention_time",
    "candidates",
    "device",
    "from_hf_config",
    "gemm_time",
    "gpt",
    "layer_activation_bytes",
    "make_cluster",
    "memory_time",
    "p2p",
    "parse_cluster",
    "peak_memory",
    "place_axes",
    "place_axis",
    "plot_memory",
    "preset",
    "reduce_scatter",
    "roofline",
    "search_configs",
    "simulate",
    "stage_memories",
    "to_chrome_trace",
]
