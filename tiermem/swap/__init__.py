"""The tensor swapper: partitions of tensors placed in tiers (device, host, NVMe) and moved asynchronously."""

from tiermem.errors import CorruptDataError, StateError
from tiermem.swap.host_cache import room_needed
from tiermem.swap.layout import Layout, TensorSlot
from tiermem.swap.ledger import Ledger, LedgerSnapshot
from tiermem.swap.partition import Partition
from tiermem.swap.state import DeviceState, HostState, Residency, Tier
from tiermem.swap.swapper import SwapStats, TensorSwapper

__all__ = [
    "CorruptDataError",
    "DeviceState",
    "HostState",
    "Layout",
    "Ledger",
    "LedgerSnapshot",
    "Partition",
    "Residency",
    "StateError",
    "SwapStats",
    "TensorSlot",
    "Tier",
    "TensorSwapper",
    "room_needed",
]
