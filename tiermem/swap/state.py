"""Tiers, and the residency of a partition's bytes in host and device memory; the members say who holds memory.

# [Note: residency]
A partition's bytes live in up to three places at once, tracked by two small state machines:

    host:    NONE ──read──► READING ──done──► READY ──evict (dirty)──► WRITING ──done──► NONE
                                               ▲  └──────evict (clean)─────────────────► NONE
                                               └────(flush: write, stay cached)─ WRITING
    device:  NONE ──reserve──► COPYING ──commit──► READY ──drop──► NONE

The NVMe copy is the extent (home nvme), current unless `dirty`. Every state but NONE holds memory of
its kind and is charged to the ledger by the transition that enters it (Partition.attach_host,
reserve_device, ...), and uncharged by the one that leaves it: where a partition is and who pays for
it are never computed in two places.

The home tier holds the authoritative copy: for home nvme or cpu that is the host buffer (a device copy
is a read-only cache of it, refreshed when the host copy changes under it); for home device on a device
with its own memory it is the device copy, and a host buffer exists only while someone holds the
partition on the host. On the CPU compute device there is no separate device memory: device READY means
the host buffer is also counted as the device working set, and no byte moves.

Only READING and WRITING have an NVMe transfer in flight, driven by the I/O engine's completion thread;
COPYING is entered and left by the compute thread (see [Note: device copies] in transfers.py).
"""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """Where bytes can rest: the compute device, (pinned) host memory, or NVMe swap files."""

    DEVICE = "device"
    CPU = "cpu"
    NVME = "nvme"


class HostState(enum.Enum):
    """The host buffer of a partition. NONE holds no host memory; the others hold one buffer."""

    NONE = "no host copy"
    READING = "reading from nvme"
    READY = "on host"
    WRITING = "writing to nvme"


class DeviceState(enum.Enum):
    """The device copy of a partition. NONE holds no device memory; the others are charged to the device."""

    NONE = "no device copy"
    COPYING = "copying to device"
    READY = "on device"


class Residency(enum.Enum):
    """A one-word summary of both states, for messages and tests: the highest tier the bytes are usable in."""

    NVME = "on nvme"
    READING = "reading from nvme"
    HOST = "on host"
    WRITING = "writing to nvme"
    TO_DEVICE = "copying to device"
    DEVICE = "on device"
