"""The cluster simulator behind ``meshfold plan``: one training step of a transformer priced analytically.

``model`` (ModelSpec, parameter and FLOP counts), ``parallel`` (ParallelConfig, TrainSpec),
``stagesplit`` (which layers each pipeline stage holds), ``layer``/``edges``/``context``/``streams``
(one layer's time on two streams), ``dataparallel`` (gradient and parameter traffic), ``footprint``
(peak memory), ``simulate`` (one step), ``search`` (outer search over configurations),
``calibration`` (the published runs the Hopper constants are fitted on and scored against),
``stage_timeline``/``trace`` (timelines and their exports). It prices with the same per-op time model
the passes use (``passes.cost``: roofline and collective times) on the hardware catalog
(``meshfold.target``). Everything is frozen data and pure functions, and nothing here imports torch,
so ``meshfold plan`` starts fast.
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
from meshfold.passes.cost.opcost import attention_time, gemm_time, memory_time, roofline
from meshfold.sim.footprint import layer_activation_bytes
from meshfold.sim.model import PRESETS, Matmul, ModelSpec, from_hf_config, gpt, preset
from meshfold.sim.parallel import (
    MOE_MAPPINGS,
    RECOMPUTE,
    SCHEDULES,
    STAGE_SPLITS,
    ConfigError,
    ParallelConfig,
    TrainSpec,
)
from meshfold.sim.result import MemoryBreakdown, MemoryPoint, SimResult, TimelineEvent
from meshfold.sim.search import Ranked, candidates, search_configs
from meshfold.sim.simulate import peak_memory, simulate, stage_memories
from meshfold.sim.trace import plot_memory, to_chrome_trace
from meshfold.target.hardware import (
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
