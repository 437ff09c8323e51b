"""tiermem: tiered memory for PyTorch (device, pinned host RAM, NVMe swap through io_uring)."""

from tiermem.config import Config, format_config, load_config
from tiermem.errors import BudgetError, ConfigError, IOEngineError, StoreError, TiermemError
from tiermem.io.aio import AsyncEngine
from tiermem.io.buffers import AlignedBuffer, HostBufferPool
from tiermem.io.engine import IOEngine, ReadPastEndError, available_backends, create_engine
from tiermem.io.files import IOFile
from tiermem.io.future import IOFuture
from tiermem.offload import OffloadError, OffloadHandle, tiered_offload
from tiermem.sizes import format_size, parse_size
from tiermem.store import Extent, SwapStore
from tiermem.swap import Partition, Residency, SwapStats, TensorSwapper, Tier

__all__ = [
    "AlignedBuffer",
    "AsyncEngine",
    "BudgetError",
    "Config",
    "ConfigError",
    "Extent",
    "HostBufferPool",
    "IOEngine",
    "IOEngineError",
    "IOFile",
    "IOFuture",
    "ReadPastEndError",
    "StoreError",
    "SwapStore",
    "TiermemError",
    "TensorSwapper",
    "Tier",
    "Partition",
    "Residency",
    "SwapStats",
    "available_backends",
    "create_engine",
    "format_config",
    "format_size",
    "load_config",
    "parse_size",
    "tiered_offload",
    "OffloadHandle",
    "OffloadError",
]
