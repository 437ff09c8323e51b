"""Partition: one flat, 4 KiB-aligned group of tensors with a home tier, and the transitions of its residency.

The transitions here are the only code that changes a partition's host and device states, and those that
take memory or give it back keep the ledger as they go (see [Note: residency] in state.py). The swapper
and its host cache call them under the swapper's lock; other modules ask the swapper and never touch
these fields.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from tiermem.errors import StateError
from tiermem.swap.layout import Layout
from tiermem.swap.state import DeviceState, HostState, Residency, Tier

if TYPE_CHECKING:
    from tiermem.io.buffers import HostBufferPool, PoolBuffer
    from tiermem.io.future import IOFuture
    from tiermem.store import Extent
    from tiermem.swap.ledger import Ledger


class Partition:
    """A group of tensors moved together. Create through `TensorSwapper.add`; move with the swapper."""

    def __init__(self, name: str, layout: Layout, home: Tier, arena: str = "main") -> None:
        self.name = name
        self.layout = layout
        self.home = home
        self.arena = arena  # the part of the host pool its host buffer comes from
        self.host_state = HostState.NONE
        self.device_state = DeviceState.NONE
        self.host: PoolBuffer | None = None  # the host buffer, while host_state is not NONE
        self.device_data: torch.Tensor | None = None  # separate device memory (CUDA, copying device); else None
        self.ready_event: object | None = None  # CUDA event of the last copy to the device, waited by compute
        # the event of the last copy to the device, which reads the host buffer: kept when the device copy is
        # dropped (the copy may still run), waited for before the buffer goes back to the pool or moves
        self.host_read_by: object | None = None
        self.extent: Extent | None = None  # where it rests on NVMe (home nvme only)
        self.checksum: int | None = None  # nvme.checksum: CRC-32 of the first `nbytes` last written, checked on reads
        self.dirty = False  # the host copy is newer than the NVMe copy (or there is no NVMe copy yet)
        self.dirty_end = 0  # while dirty: the bytes from the start that may differ; the rest equals the NVMe copy
        self.version = 0  # bumped on every change of the host copy; a write-back is current only if equal
        self.written_version = -1  # `version` captured when the write in flight started
        self.holders: Counter[Tier] = Counter()  # acquire() not yet released, by tier (HOST, DEVICE)
        self.prefetched = False  # fetched ahead and not acquired since: evicted only when nothing else can be
        self.want_device = False  # a prefetch asked for the device: copy once the host bytes are in
        self.last_used = 0  # swapper clock at the last fetch or release, for LRU eviction
        self.pending: IOFuture | None = None  # the one NVMe transfer in flight (READING or WRITING)
        self.free_after_write = False  # the write in flight is an eviction: drop the host buffer after
        self.waiters: list[IOFuture] = []  # futures completing when the host bytes are in
        self.resident = False  # kept in host memory between uses: evicted only when nothing else can be
        self.discarded = False  # contents dropped (TensorSwapper.discard): the next fetch reads nothing
        self.zero_on_fill = True  # with discarded: that fetch zeroes the buffer (else hands it out as it is)
        self.host_loads = 0  # host buffers attached so far: unchanged while one copy stays in host memory
        # the views made last per tier, and the storage they view: the same buffer gives the same views (a
        # training step asks for every partition's views several times; making them costs more than the update
        # of a small unit). Dropping a tier's memory drops its views, so no view keeps freed memory alive.
        self._views: dict[str, tuple[object, dict[str, torch.Tensor]]] = {}

    @property
    def size(self) -> int:
        """Bytes this partition occupies in each tier (4 KiB-aligned)."""
        return self.layout.size

    @property
    def nbytes(self) -> int:
        """Bytes up to the end of the last tensor (`size` less the padding to 4 KiB)."""
        return self.layout.nbytes

    @property
    def users(self) -> int:
        """acquire() calls not yet released, in any tier; a used partition is never evicted or demoted."""
        return sum(self.holders.values())

    @property
    def state(self) -> Residency:
        """Where the bytes are usable now, summarised (see [Note: residency] in state.py)."""
        if self.device_state is DeviceState.READY:
            return Residency.DEVICE
        if self.device_state is DeviceState.COPYING:
            return Residency.TO_DEVICE
        return {HostState.NONE: Residency.NVME, HostState.READING: Residency.READING,
                HostState.READY: Residency.HOST, HostState.WRITING: Residency.WRITING}[self.host_state]

    def has_host_bytes(self) -> bool:
        """The host buffer holds the partition's bytes (not still being read)."""
        return self.host_state in (HostState.READY, HostState.WRITING)

    def reached(self, tier: Tier) -> bool:
        """Whether the bytes are usable in `tier` ('host' or 'device') now."""
        if tier == Tier.DEVICE:
            return self.device_state is DeviceState.READY
        return self.has_host_bytes()

    # -- transitions (the swapper's lock held) ----------------------------------------------------------
    def attach_host(self, buf: PoolBuffer, ledger: Ledger, state: HostState = HostState.READY) -> None:
        """NONE -> `state` with `buf` as the host buffer; charges the host ledger."""
        if self.host_state is not HostState.NONE:
            raise StateError(f"partition {self.name!r} has a host buffer already")
        ledger.add("host", self.size, f"partition {self.name!r}", arena=self.arena)
        self.host = buf
        self.host_state = state
        self.host_loads += 1

    def read_done(self) -> None:
        """READING -> READY: the read from NVMe has landed in the host buffer."""
        self.host_state = HostState.READY

    def write_started(self) -> None:
        """READY -> WRITING: a write-back of the host buffer to NVMe is queued."""
        self.host_state = HostState.WRITING

    def write_done(self) -> None:
        """WRITING -> READY: the write-back ended (failed or not, the host copy stays)."""
        self.host_state = HostState.READY

    def detach_host(self, pool: HostBufferPool, ledger: Ledger) -> None:
        """Any -> NONE: the host buffer goes back to the pool; nothing when there is none."""
        if self.host is None:
            return
        if self.device_state is not DeviceState.NONE and self.device_data is None:
            raise StateError(f"partition {self.name!r}: its host buffer is its device copy; drop that first")
        self.wait_copy_from_host()
        pool.free(self.host)
        ledger.sub("host", self.size, arena=self.arena)
        self.host = None
        self.host_state = HostState.NONE
        self._views.pop("host", None)

    @property
    def movable(self) -> bool:
        """Whether its host copy may move to another buffer (the pool's compaction): it is idle, with no
        transfer, no user and no device copy over the host buffer, so nothing points into its bytes."""
        return (self.host is not None and self.host_state is HostState.READY and self.pending is None
                and not self.users and not self.waiters
                and (self.device_state is DeviceState.NONE
                     or (self.device_state is DeviceState.READY and self.device_data is not None)))

    def move_host(self, buf: PoolBuffer) -> PoolBuffer:
        """Hand the host bytes over to `buf` (copied) and return the old buffer, for the caller to free: the
        pool's compaction. Only a `movable` partition moves."""
        if not self.movable:
            raise StateError(f"partition {self.name!r} is {self.state.value} with users or transfers; it cannot move")
        old = self.host
        assert old is not None  # movable
        self.wait_copy_from_host()
        buf.numpy()[: old.nbytes] = old.numpy()
        self.host = buf
        self._views.pop("host", None)
        return old

    def copying_from_host(self, event: object | None) -> None:
        """A copy of the host buffer to the device started; `event` marks its end."""
        self.ready_event = self.host_read_by = event

    def wait_copy_from_host(self) -> None:
        """Block until the last copy to the device, which reads the host buffer, has landed: a buffer handed
        back to the pool before then is refilled under the copy (see [Note: device copies]), even when its
        device copy was dropped meanwhile."""
        if self.host_read_by is not None:
            self.host_read_by.synchronize()  # type: ignore[attr-defined]
            self.host_read_by = None

    def mark_dirty(self, end: int | None = None) -> None:
        """The host copy changed in its first `end` bytes (default: anywhere); only NVMe partitions have a
        copy to get out of date. A write-back then writes those bytes, 4 KiB-aligned, not the whole."""
        if self.home is not Tier.NVME:
            return
        end = self.size if end is None else min(self.size, end)
        self.dirty_end = max(self.dirty_end, end) if self.dirty else end
        self.dirty = True

    def mark_clean(self) -> None:
        """Nothing to write back: a write of the current host copy has landed, or the contents were discarded."""
        self.dirty = False
        self.dirty_end = 0

    def forget(self, ledger: Ledger) -> None:
        """Any -> NONE in both tiers as the swapper closes: drops the buffers and every view of them (the
        pool goes as a whole), so a Partition object kept afterwards holds none of its memory."""
        self.drop_device(ledger)
        if self.host is not None:
            ledger.sub("host", self.size, arena=self.arena)
        self.host = None
        self.host_read_by = None  # the swapper waited for every copy before closing
        self.host_state = HostState.NONE
        self._views.clear()

    def reserve_device(self, ledger: Ledger) -> None:
        """NONE -> COPYING: charges the device ledger (raises BudgetError over the budget)."""
        if self.device_state is not DeviceState.NONE:
            return
        ledger.add("device", self.size, f"partition {self.name!r}")
        self.device_state = DeviceState.COPYING

    def commit_device(self, data: torch.Tensor | None, event: object | None) -> None:
        """COPYING -> READY with the device memory made for it (None: the host buffer serves as device), once
        the copy has started; `event` marks its end (CUDA), and compute waits on it."""
        if self.device_state is not DeviceState.COPYING:
            raise StateError(f"partition {self.name!r} is {self.state.value}, not copying to the device")
        self.device_data = data
        self.copying_from_host(event)
        self.device_state = DeviceState.READY

    def drop_device(self, ledger: Ledger) -> None:
        """Any -> NONE: forgets the device memory and its views, and uncharges it; nothing when there is none."""
        if self.device_state is DeviceState.NONE:
            return
        ledger.sub("device", self.size)
        self.device_state = DeviceState.NONE
        self.device_data = None
        self.ready_event = None
        self._views.pop("device", None)

    # -- views ----------------------------------------------------------------------------------------
    def tensors(self, tier: Tier | None = None) -> dict[str, torch.Tensor]:
        """The partition's tensors as views of its memory in `tier` ('host' or 'device'; default: the
        device when it is there, else the host), by name."""
        backing = self._backing(tier)
        key = "device" if backing is self.device_data else "host"  # on the CPU device both are the host buffer
        cached = self._views.get(key)
        if cached is None or cached[0] is not backing:
            flat = backing if isinstance(backing, torch.Tensor) else backing.tensor()
            cached = (backing, self.layout.views(flat))
            self._views[key] = cached
        return dict(cached[1])

    def flat(self, tier: Tier | None = None) -> torch.Tensor:
        """The whole partition as one uint8 tensor in `tier`'s memory (default as for `tensors`)."""
        backing = self._backing(tier)
        return backing if isinstance(backing, torch.Tensor) else backing.tensor()

    def _backing(self, tier: Tier | None) -> torch.Tensor | PoolBuffer:
        if tier is None:
            tier = Tier.DEVICE if self.device_state is DeviceState.READY else Tier.HOST
        if tier == Tier.DEVICE and self.device_state is DeviceState.READY:
            if self.device_data is not None:
                return self.device_data
            assert self.host is not None  # the CPU device: the host buffer is the device copy
            return self.host
        if tier == Tier.HOST and self.has_host_bytes():
            assert self.host is not None
            return self.host
        raise StateError(f"partition {self.name!r} is {self.state.value}; acquire or fetch it in {tier} memory "
                         "before using its tensors")

    def __repr__(self) -> str:
        return f"Partition({self.name!r}, {self.size} bytes, home={self.home.value}, {self.state.value})"
