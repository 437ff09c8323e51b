"""Tiers and residency states of a partition; the members say who holds memory.

# [Note: residency]
    NVME ──fetch──► READING ──(read done)──► HOST ──fetch device──► TO_DEVICE ──► DEVICE
      ▲                                       │ ▲                                   │
      └──────(write done)── WRITING ◄──evict──┘ └──────── TO_HOST ◄──release────────┘
A partition in READING, WRITING, TO_DEVICE or TO_HOST has exactly one transfer in flight; a second
request for it chains on that transfer instead of starting another. On a CPU-only machine the device
tier is host memory: HOST -> DEVICE is a state change on the same buffer, with no copy.
"""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """Where bytes can rest: the compute device, (pinned) host memory, or NVMe swap files."""

    DEVICE = "device"
    CPU = "cpu"
    NVME = "nvme"


class Residency(enum.Enum):
    """Where a partition's bytes are now. `holds_host`/`holds_device` say which memory it occupies."""

    NVME = "on nvme"
    READING = "reading from nvme"
    HOST = "on host"
    TO_DEVICE = "copying to device"
    DEVICE = "on device"
    TO_HOST = "copying to host"
    WRITING = "writing to nvme"

    @property
    def in_flight(self) -> bool:
        return self in (Residency.READING, Residency.TO_DEVICE, Residency.TO_HOST, Residency.WRITING)

    @property
    def holds_host(self) -> bool:
        return self is not Residency.NVME

    @property
    def on_device(self) -> bool:
        return self in (Residency.TO_DEVICE, Residency.DEVICE, Residency.TO_HOST)
