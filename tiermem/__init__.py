"""tiermem: tiered memory for PyTorch (device, pinned host RAM, NVMe swap through io_uring).

The public face is the entry point (`tiered_offload` and the `OffloadHandle` it yields), its configuration
(`Config`, `load_config`), the memory plan made before running (`plan`, `Plan`), the optimizer stand-in
(`TieredOptimizer`) and the errors (`TiermemError` and its subclasses). The layers below stay importable from
their subpackages: `tiermem.io` (engines, buffers, files), `tiermem.store` (swap files, extents), `tiermem.swap`
(partitions, the tensor swapper), `tiermem.sizes`.
"""

from tiermem.config import Config, load_config
from tiermem.errors import (
    BenchArgError,
    BudgetError,
    CheckpointError,
    ConfigError,
    CorruptDataError,
    CPUAllocatorError,
    DemoArgError,
    DeviceMismatchError,
    IOEngineError,
    IOTimeoutError,
    OffloadError,
    OptimizerError,
    RanksError,
    ReadPastEndError,
    RestoreError,
    StateError,
    StoreError,
    TiermemError,
)
from tiermem.offload import OffloadHandle, tiered_offload
from tiermem.optim import TieredOptimizer
from tiermem.planning import Plan, plan

__all__ = [
    "BenchArgError",
    "BudgetError",
    "CPUAllocatorError",
    "CheckpointError",
    "Config",
    "ConfigError",
    "CorruptDataError",
    "DemoArgError",
    "DeviceMismatchError",
    "IOEngineError",
    "IOTimeoutError",
    "OffloadError",
    "OffloadHandle",
    "OptimizerError",
    "Plan",
    "RanksError",
    "ReadPastEndError",
    "RestoreError",
    "StateError",
    "StoreError",
    "TieredOptimizer",
    "TiermemError",
    "load_config",
    "plan",
    "tiered_offload",
]
