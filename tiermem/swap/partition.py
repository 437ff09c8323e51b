"""Partition: one flat, 4 KiB-aligned buffer holding a group of tensors, with a home tier and a residency."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tiermem.errors import TiermemError
from tiermem.swap.layout import Layout
from tiermem.swap.state import Residency, Tier

if TYPE_CHECKING:
    from tiermem.io.buffers import PoolBuffer
    from tiermem.io.future import IOFuture
    from tiermem.store import Extent


class StateError(TiermemError):
    """A partition was used in a state that does not allow it (e.g. its tensors read while on NVMe)."""


class Partition:
    """A group of tensors moved together. Create through `TensorSwapper.add`; move with its methods."""

    def __init__(self, name: str, layout: Layout, home: Tier) -> None:
        self.name = name
        self.layout = layout
        self.home = home
        self.state = Residency.NVME
        self.host: PoolBuffer | None = None  # the host buffer while state.holds_host
        self.device_data: torch.Tensor | None = None  # device storage on CUDA; None on the CPU
        self.ready_event: object | None = None  # CUDA event of the last H2D copy, waited by compute
        self.extent: Extent | None = None  # where it rests on NVMe (home nvme only)
        self.checksum: int | None = None  # crc32 written with the NVMe copy when nvme.checksum is on
        self.dirty = False  # the host copy is newer than the NVMe copy (or there is no NVMe copy yet)
        self.version = 0  # bumped on every change of the host copy; a write-back is current only if equal
        self.written_version = -1  # `version` captured when the write in flight started
        self.users = 0  # acquire() calls not yet released; a used partition is never evicted
        self.prefetched = False  # fetched ahead and not acquired since: evicted only when nothing else can be
        self.last_used = 0  # swapper clock at the last fetch or release, for LRU eviction
        self.pending: IOFuture | None = None  # the one NVMe transfer in flight
        self.free_after_write = False  # the write in flight is an eviction: drop the host buffer after
        self.waiters: list[tuple[str, IOFuture]] = []  # (target tier, future) waiting for a transfer
        self.pinned = False  # kept in host memory between uses: evicted only when nothing else can be
        self.discarded = False  # contents dropped (TensorSwapper.discard): the next fetch gives zeros, no read
        # the views `tensors()` made last, and the buffer they view: the same buffer gets the same views (a
        # training step asks for every partition's views several times; making them costs more than the update
        # of a small unit)
        self._views: tuple[torch.Tensor | PoolBuffer, dict[str, torch.Tensor]] | None = None

    @property
    def size(self) -> int:
        """Bytes this partition occupies in each tier (4 KiB-aligned)."""
        return self.layout.size

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return self.layout.nbytes

    def reached(self, target: str) -> bool:
        """Whether the bytes are usable in `target` ('host' or 'device') now."""
        if target == "device":
            return self.state is Residency.DEVICE
        return self.state in (Residency.HOST, Residency.DEVICE, Residency.TO_DEVICE, Residency.WRITING)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The partition's tensors as views of wherever its bytes are now (device first), by name."""
        backing: torch.Tensor | PoolBuffer
        if self.state is Residency.DEVICE and self.device_data is not None:
            backing = self.device_data
        elif self.host is None or self.state in (Residency.NVME, Residency.READING):
            raise StateError(f"partition {self.name!r} is {self.state.value}; acquire or fetch it before using "
                             "its tensors")
        else:
            backing = self.host
        if self._views is None or self._views[0] is not backing:
            flat = backing if isinstance(backing, torch.Tensor) else backing.tensor()
            self._views = (backing, self.layout.views(flat))
        return dict(self._views[1])

    def __repr__(self) -> str:
        return f"Partition({self.name!r}, {self.size} bytes, home={self.home.value}, {self.state.value})"
