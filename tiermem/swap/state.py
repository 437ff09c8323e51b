"""Tiers, and the residency of a partition's bytes in host and device memory; the members say who holds memory.

# [Note: residency]
A partition's bytes live in up to three places at once, tracked by two small state machines. Every
transition is a method of Partition (partition.py):

    host:    NONE ──attach_host(READING)──► READING ──read_done──► READY ──write_started──► WRITING
             NONE ◄──detach_host (read failed)── READING               READY ◄──write_done───── WRITING
             NONE ──attach_host──────────────────────────────────────► READY
             NONE ◄──detach_host──────────────────────────────────────  READY
    device:  NONE ──reserve_device──► COPYING ──commit_device──► READY ──drop_device──► NONE
             NONE ◄──drop_device (allocation or copy failed)── COPYING

Host. A read from NVMe (HostCache.fill) enters READING; its completion (HostCache._read_done, on the I/O
engine's thread) READY, or NONE when it failed. attach_host goes straight to READY where there is
nothing to read: a new partition (TensorSwapper.add), a discarded one coming back (zeroed, or as the
pool has it), and the host copy of a partition homed on the device, copied from its device copy at
once. A write-back (HostCache.start_write: an eviction of a dirty partition, `flush`, `write_back`)
enters WRITING, and its completion always returns to READY: a failed write keeps the host copy, dirty.
An eviction then drops the host copy (detach_host) if it is still clean and nobody uses, waits for or
has it on the device; a clean eviction drops it at once. `discard` and `remove` drop it too, and so do
`add` and `release` for a partition homed on a device with its own memory (its device copy is the
partition); `forget` drops everything at close.

Device. reserve_device charges the device's share before any memory is allocated; the compute thread
then allocates and starts the copy without the lock (TensorSwapper._to_device). COPYING is that
window: the host buffer it copies from is neither evicted (HostCache.alloc) nor dropped after a write
(HostCache._write_done). commit_device enters READY as soon as the copy has started: on CUDA it may
still run on the side stream, and `ready_event` orders the compute stream after it (see [Note: device
copies] in transfers.py). On the CPU compute device nothing is allocated or copied: COPYING lasts from
reserve to commit and no longer, and device READY means the host buffer is also counted as the device
working set.

The NVMe copy is the extent (home nvme), current unless `dirty`. Every state but NONE holds memory of
its kind and is charged to the ledger by the transition that enters it from NONE (attach_host,
reserve_device), and uncharged by the one that returns to NONE (detach_host, drop_device, forget):
where a partition is and who pays for it are never computed in two places.

The home tier holds the authoritative copy: for home nvme or cpu that is the host buffer (a device copy
is a read-only cache of it, refreshed when the host copy changes under it); for home device on a device
with its own memory it is the device copy, and a host buffer exists only while someone holds the
partition on the host.

Only READING and WRITING have an NVMe transfer in flight (`Partition.pending`), completed on the I/O
engine's thread. Device memory is allocated, copied and freed by the compute thread only; on the CPU
device, where there is none, a read's completion may take a prefetched partition's device state to
READY itself (TensorSwapper._read_to_shared_device). A change made in one tier is copied to the other
by `release(dirty=True)`, with no change of state.
"""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """Where bytes can rest: the compute device, host memory, or NVMe swap files. The swapper's calls name
    the tier to bring a partition to with these (`Tier.HOST`, `Tier.DEVICE`)."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    @classmethod
    def of(cls, word: str | Tier) -> Tier:
        """The tier a config value names: `*.tier: cpu` (the configs' word for host memory) is HOST."""
        if isinstance(word, Tier):
            return word
        if word == "cpu":
            return cls.HOST
        try:
            return cls(word)
        except ValueError:
            raise ValueError(f"expected one of device, cpu, nvme, got {word!r}") from None


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
    """A one-word summary of both states, for messages and tests: the device state unless it is NONE, else
    the host state."""

    NVME = "on nvme"
    READING = "reading from nvme"
    HOST = "on host"
    WRITING = "writing to nvme"
    TO_DEVICE = "copying to device"
    DEVICE = "on device"
