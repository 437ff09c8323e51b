"""TensorSwapper: owns every partition's tier state and moves partitions between device, host and NVMe.

# [Note: swapper locking]
One re-entrant lock guards all partition states, the host pool and the ledger. Completions of NVMe
transfers arrive on the engine's thread and take the same lock to advance the partition. Nothing
blocks while holding the lock: a caller that must wait (for an eviction's write-back to free host
memory, or for its own fetch) waits on a future after letting go of it, so waiting on one partition
never stalls transfers of the others.

# [Note: host budget]
All host memory for partitions comes from one HostBufferPool of memory.host_budget bytes, allocated
once. When a fetch needs room, the least recently used idle partitions whose home is NVMe are
evicted: dropped at once when their NVMe copy is current, written back first when dirty. A partition
larger than the whole budget, or a budget full of partitions in use, raises BudgetError naming them.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.config import Config, load_config
from tiermem.errors import BudgetError, StoreError
from tiermem.io.buffers import HostBufferPool, PoolBuffer
from tiermem.io.engine import IOEngine, create_engine
from tiermem.io.future import IOFuture
from tiermem.sizes import format_size
from tiermem.store import SwapStore
from tiermem.swap.device import DeviceMover, resolve_device
from tiermem.swap.layout import Layout
from tiermem.swap.ledger import Ledger, LedgerSnapshot
from tiermem.swap.partition import Partition, StateError
from tiermem.swap.state import Residency, Tier

log = logging.getLogger(__name__)


class CorruptDataError(StoreError):
    """Bytes read back from NVMe do not match the checksum written with them."""


@dataclass(frozen=True)
class SwapStats:
    """Counters since the last reset, and the ledger (bytes per tier now and at peak)."""

    ledger: LedgerSnapshot
    bytes_read: int
    bytes_written: int
    evictions: int
    partitions: int


class TensorSwapper:
    """Places groups of tensors (partitions) in tiers and moves them asynchronously; a context manager.

    Args:
        config: anything `tiermem.load_config` takes (None, a YAML path, a dict, a Config).
        engine: an I/O engine to use instead of one built from the io.* settings (not closed here).
        **overrides: dotted-key overrides, e.g. ``**{"memory.host_budget": "256MiB"}``.

    Example::

        with TensorSwapper("configs/nvme.yaml") as swapper:
            part = swapper.add("layer0", {"weight": w, "bias": b}, home="nvme")
            swapper.prefetch(part)                      # starts the NVMe read, returns at once
            tensors = swapper.acquire(part)             # waits; views on the compute device
            ...
            swapper.release(part, dirty=True)           # changed: written back when evicted
    """

    def __init__(self, config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
                 engine: IOEngine | None = None, **overrides: Any) -> None:
        self.config = load_config(config, **overrides)
        cfg = self.config
        self.device = resolve_device(cfg.device)
        self.mover = DeviceMover(self.device)
        self._lock = threading.RLock()
        self._clock = 0  # advances on every fetch/release; orders LRU eviction
        self.partitions: dict[str, Partition] = {}  # by name, in insertion order
        # every partition's host bytes come from here; the activations' buffer is the budget's other part
        self.pool = HostBufferPool(cfg.memory.host_budget - cfg.activations.host_bytes)
        self.ledger = Ledger(host_budget=self.pool.nbytes, device_budget=cfg.memory.device_budget)
        self._engine: IOEngine | None = engine  # made on first NVMe use unless given
        self._own_engine = engine is None  # close it on close() only if we made it
        # Registering the pool with the engine faults in (and pins) every page of it at once; `tiered_offload`
        # defers that until the model's own parameters are packed and freed, so the two never add up.
        self.defer_registration = False
        self._pool_registered = False
        self._store: SwapStore | None = None  # made on first NVMe use
        self.bytes_read = 0
        self.bytes_written = 0
        self.evictions = 0
        self.closed = False
        # Optional: how soon a partition is needed again (larger = later). With it, eviction drops the
        # partition needed last (the runtime knows the schedule); without it, the least recently used.
        self.next_use: Callable[[Partition], float] | None = None

    @property
    def budget_text(self) -> str:
        """The host budget partitions share, as error messages name it."""
        size = format_size(self.pool.nbytes)
        if self.config.activations.host_bytes:
            return f"memory.host_budget less activations.buffer ({size})"
        return f"memory.host_budget ({size})"

    # -- NVMe resources, made lazily so host-only configs never touch a disk --------------------------
    @property
    def engine(self) -> IOEngine:
        """The I/O engine (io.* settings), made on first use; the host pool is registered with it."""
        with self._lock:
            if self._engine is None:
                io = self.config.io
                self._engine = create_engine(io.engine, block_size=io.block_size, queue_depth=io.queue_depth,
                                             sqpoll=io.sqpoll)
                if not self.defer_registration:
                    self.register_pool()
            return self._engine

    def register_pool(self) -> None:
        """Register the host pool with the engine this swapper made (fixed buffers), once."""
        with self._lock:
            self.defer_registration = False
            if self._engine is None or not self._own_engine or self._pool_registered:
                return
            self._pool_registered = True
            engine = self._engine
        # not under the lock: the engine's thread may need it to finish a write first (_write_done)
        engine.register_buffers(self.pool.regions)

    @property
    def store(self) -> SwapStore:
        with self._lock:
            return self._store or self._open_store()

    def _open_store(self) -> SwapStore:
        if self._store is None:
            io = self.config.io
            nv = self.config.nvme
            self._store = SwapStore(list(nv.paths), self.engine, stripe_size=nv.stripe_size,
                                    keep_files=nv.keep_files, direct=io.direct)
        return self._store

    # -- partitions ---------------------------------------------------------------------------------
    def add(self, name: str, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
            home: str | Tier = Tier.NVME,
            fill: Callable[[dict[str, torch.Tensor]], None] | None = None, zero: bool = False) -> Partition:
        """Pack `tensors` (copied) into a new partition resting in `home` ('device', 'cpu' or 'nvme').

        With `fill`, `tensors` only give names, dtypes and shapes (meta tensors will do) and
        `fill(views)` writes the data into the partition's views instead. `zero` clears the whole
        buffer first, padding included (so flat views over it hold zeros between tensors); with `zero`
        and no `fill`, `tensors` only give the layout. An NVMe
        partition starts on host, dirty, and is written out when evicted or on `flush()`.
        """
        if self.closed:
            raise StateError("the swapper is closed")
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        try:
            tier = Tier(home)
        except ValueError:
            raise ValueError(f"home: expected one of device, cpu, nvme, got {home!r}") from None
        with self._lock:
            if name in self.partitions:
                raise ValueError(f"a partition named {name!r} exists already")
        layout = Layout.of(items)
        part = Partition(name, layout, tier)
        if tier is Tier.NVME:
            part.extent = self.store.allocate(layout.size)
        try:
            views = self._place_new(part)
        except BaseException:
            if part.extent is not None:
                self.store.free(part.extent)
            raise
        try:
            with torch.no_grad():
                if zero:
                    self.flat(part).zero_()
                if fill is not None:
                    fill(views)
                elif not zero:
                    for slot_name, t in items:
                        views[slot_name].copy_(t.detach())
        except BaseException:
            with self._lock:
                self._drop_device(part)
                self._free_host(part)
                if part.extent is not None:
                    self.store.free(part.extent)
            raise
        part.dirty = tier is Tier.NVME
        with self._lock:
            self._clock += 1
            part.last_used = self._clock
            self.partitions[name] = part
        return part

    def _place_new(self, part: Partition) -> dict[str, torch.Tensor]:
        """Give a new partition its memory in its first tier; return the tensor views to fill."""
        tier, layout, name = part.home, part.layout, part.name
        if tier is Tier.DEVICE and self.mover.copies:
            self._charge_device(part)
            part.device_data = torch.zeros(layout.size, dtype=torch.uint8, device=self.device)
            views = layout.views(part.device_data)
            part.state = Residency.DEVICE
        else:
            part.host = self._alloc_host(part)
            self.ledger.add("host", part.size, name)
            if tier is Tier.DEVICE:
                self._charge_device(part)
            part.state = Residency.DEVICE if tier is Tier.DEVICE else Residency.HOST
            views = layout.views(part.host.tensor())
        return views

    def flat(self, part: Partition) -> torch.Tensor:
        """The whole partition as one uint8 tensor where its bytes are now (device first)."""
        if part.state is Residency.DEVICE and part.device_data is not None:
            return part.device_data
        if part.host is None:
            raise StateError(f"partition {part.name!r} is {part.state.value}; fetch it first")
        return part.host.tensor()

    def remove(self, part: Partition) -> None:
        """Forget a partition and give back its memory and swap space."""
        self.wait_idle(part)
        with self._lock:
            if part.users:
                raise StateError(f"partition {part.name!r} is in use ({part.users} acquire without release)")
            self._drop_device(part)
            if part.host is not None:
                self._free_host(part)
            if part.extent is not None:
                self.store.free(part.extent)
                part.extent = None
            part.state = Residency.NVME
            del self.partitions[part.name]

    # -- moving -------------------------------------------------------------------------------------
    def fetch(self, part: Partition, tier: str = "device", *, wait_for_memory: bool = True) -> IOFuture:
        """Start moving `part` up to `tier` ('host' or 'device'); return a future that completes there.

        `wait_for_memory=False` raises BudgetError at once instead of waiting for write-backs or reads
        in flight to free host memory (what a prefetch wants: never stall the caller).
        """
        if tier not in ("host", "device"):
            raise ValueError(f"tier: expected 'host' or 'device', got {tier!r}")
        with self._lock:
            self._clock += 1
            part.last_used = self._clock
            fut = IOFuture(part.size, 1)
            if part.reached(tier):
                fut._chunk_done(None)
                return fut
            part.waiters.append((tier, fut))
            need_buffer = part.state is Residency.NVME
        if need_buffer:
            try:
                buf = self._alloc_host(part, wait=wait_for_memory)  # may evict others, wait for write-backs
            except BaseException:
                with self._lock:
                    part.waiters = [(t, f) for t, f in part.waiters if f is not fut]
                raise
            with self._lock:
                if part.state is Residency.NVME and part.host is None:
                    part.host = buf
                    self.ledger.add("host", part.size, part.name)
                else:
                    self.pool.free(buf)  # another fetch got there first
        with self._lock:
            self._drive(part)
        return fut

    def prefetch(self, part: Partition, tier: str = "device") -> IOFuture | None:
        """Start a fetch that never blocks: None (nothing started) when host memory is not free now."""
        try:
            fut = self.fetch(part, tier, wait_for_memory=False)
        except BudgetError:
            return None
        part.prefetched = True
        return fut

    def acquire(self, part: Partition, tier: str = "device",
                before_wait: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
        """Bring `part` to `tier`, wait, mark it in use, and return its tensors there (views).

        `before_wait` runs once `part` is marked in use (so nothing evicts it) and its transfer has
        started, before blocking: the place to start other transfers that should overlap this one.
        """
        fut = self.fetch(part, tier)
        with self._lock:
            part.users += 1  # counted before waiting, so eviction cannot take it from under us
            part.prefetched = False
        try:
            if before_wait is not None:
                before_wait()
            fut.wait()
        except BaseException:
            with self._lock:
                part.users -= 1
            raise
        self.mover.make_current_wait(part.ready_event)
        if part.device_data is not None and self.mover.copies:
            # allocated on the side stream, used on the compute stream: the caching allocator must not
            # hand this memory out again before the compute stream is done with it
            part.device_data.record_stream(torch.cuda.current_stream(self.device))
        return part.tensors()

    def release(self, part: Partition, *, dirty: bool = False, keep: bool = False) -> None:
        """End one use. `dirty`: its tensors changed and must reach its home tier when evicted.

        When nobody uses it any more, it leaves the device (its home tier permitting) unless `keep`
        (it is needed again soon), and stays on host as a cache until the host budget needs the room.
        """
        with self._lock:
            if part.users <= 0:
                raise StateError(f"partition {part.name!r} released more often than acquired")
            part.users -= 1
            self._clock += 1
            part.last_used = self._clock
            if dirty:
                if part.state is Residency.DEVICE and part.device_data is not None and part.host is not None:
                    self.mover.synchronize(self.mover.to_host(part.device_data, part.host.tensor()))
                part.dirty = part.home is Tier.NVME
                part.version += 1  # a write-back in flight now carries older bytes: it must not clear dirty
            if part.users == 0 and part.home is not Tier.DEVICE and not keep:
                self._demote_to_host(part)

    def demote(self, part: Partition) -> None:
        """Move an idle partition off the device (to host); nothing happens if it is in use or not there."""
        with self._lock:
            if not part.users and part.home is not Tier.DEVICE:
                self._demote_to_host(part)

    def evict(self, part: Partition) -> IOFuture:
        """Move an idle partition down to its home tier (writing it back if dirty); return the future."""
        with self._lock:
            if part.users:
                raise StateError(f"partition {part.name!r} is in use; release it before evicting")
            if part.state is Residency.DEVICE and part.home is not Tier.DEVICE:
                self._demote_to_host(part)
            if part.home is not Tier.NVME or part.state is not Residency.HOST:
                fut = IOFuture(0, 1)
                pending = part.pending
                if pending is None:
                    fut._chunk_done(None)
                    return fut
                return pending
            return self._start_eviction(part)

    def flush(self) -> None:
        """Write every dirty NVMe partition on host back to disk (they stay cached) and wait."""
        futures = []
        with self._lock:
            for part in self.partitions.values():
                if part.home is Tier.NVME and part.dirty and part.state is Residency.HOST:
                    futures.append(self._start_write(part, free_after=False))
        for f in futures:
            f.wait()
        if self._store is not None:
            self._store.flush()

    def evict_idle(self) -> None:
        """Evict every idle NVMe partition (writing back the dirty ones) and wait: the host pool is then as
        empty as it can be, e.g. before placing long-lived partitions so they pack together."""
        with self._lock:
            idle = [p for p in self.partitions.values() if p.home is Tier.NVME and not p.users and not p.waiters
                    and p.state in (Residency.HOST, Residency.DEVICE)]
        for part in idle:
            self.evict(part).wait()

    def discard(self, part: Partition) -> None:
        """Drop the contents of an idle partition and give its memory back, whatever its home tier; nothing is
        written. The next fetch hands out zeros without reading (e.g. gradient accumulators after an update).
        """
        self.wait_idle(part)
        with self._lock:
            if part.users or part.waiters:
                raise StateError(f"partition {part.name!r} is in use; release it before discarding it")
            self._drop_device(part)
            self._free_host(part)
            part.state = Residency.NVME
            part.discarded = True
            part.dirty = False
            part.prefetched = False
            part.checksum = None
            part.version += 1

    def wait_idle(self, part: Partition) -> None:
        """Block until `part` has no transfer in flight."""
        while True:
            with self._lock:
                pending = part.pending
            if pending is None:
                return
            try:
                pending.wait()
            except Exception:  # noqa: BLE001 - the owner of that transfer reports its error
                pass

    # -- state machine (lock held) ------------------------------------------------------------------
    def _drive(self, part: Partition) -> None:
        """Advance `part` toward its waiters' targets and complete the waiters it has reached."""
        if part.state is Residency.NVME and part.waiters and part.host is not None:
            if part.discarded:  # nothing to read: the contents are zeros
                part.host.tensor().zero_()
                part.discarded = False
                part.dirty = part.home is Tier.NVME
                part.state = Residency.HOST
            else:
                self._start_read(part)
        if part.state is Residency.HOST and any(t == "device" for t, _ in part.waiters):
            try:
                self._to_device(part)
            except BudgetError as exc:
                self._fail_waiters(part, exc)
                return
        done = [(t, f) for t, f in part.waiters if part.reached(t)]
        if done:
            part.waiters = [(t, f) for t, f in part.waiters if not part.reached(t)]
            for _, f in done:
                f._chunk_done(None)

    def _fail_waiters(self, part: Partition, error: BaseException) -> None:
        waiters, part.waiters = part.waiters, []
        for _, f in waiters:
            f._chunk_done(error)

    def _start_read(self, part: Partition) -> None:
        assert part.extent is not None and part.host is not None
        part.state = Residency.READING
        fut = self.store.read(part.extent, part.host.view, part.size)
        part.pending = fut
        fut.add_done_callback(lambda f: self._read_done(part, f))

    def _read_done(self, part: Partition, fut: IOFuture) -> None:
        with self._lock:
            part.pending = None
            error = fut.exception()
            if error is None and part.checksum is not None and part.host is not None:
                got = zlib.crc32(part.host.view[: part.nbytes])
                if got != part.checksum:
                    error = CorruptDataError(
                        f"partition {part.name!r}: bytes read from {', '.join(self.store.run_dirs)} do not match "
                        f"their checksum ({got:#010x} != {part.checksum:#010x}); the swap files were changed or "
                        "the drive returned bad data. Check the drive (dmesg, smartctl) and rerun"
                    )
            if error is not None:
                self._free_host(part)
                part.state = Residency.NVME
                self._fail_waiters(part, error)
                return
            self.bytes_read += part.size
            part.state = Residency.HOST
            self._drive(part)

    def _start_write(self, part: Partition, *, free_after: bool) -> IOFuture:
        assert part.extent is not None and part.host is not None
        if self.config.nvme.checksum:
            part.checksum = zlib.crc32(part.host.view[: part.nbytes])
        before = part.state
        part.state = Residency.WRITING
        part.free_after_write = free_after
        part.written_version = part.version
        raw = self.store.write(part.extent, part.host.view, part.size)
        # what callers wait on completes after _write_done has recorded the write, not when the bytes land
        done = IOFuture(raw.nbytes, 1)
        part.pending = done
        raw.add_done_callback(lambda f: self._write_done(part, f, before, done))
        return done

    def _write_done(self, part: Partition, fut: IOFuture, before: Residency, done: IOFuture) -> None:
        error = fut.exception()
        try:
            with self._lock:
                part.pending = None
                if error is not None:  # the host copy is still there and still dirty: nothing is lost
                    log.error("write-back of partition %r failed: %s", part.name, error)
                    part.state = before
                    self._drive(part)
                    return
                self.bytes_written += part.size
                part.dirty = part.version != part.written_version  # changed while the write was in flight
                if part.free_after_write and not part.waiters and not part.users and not part.dirty:
                    self._free_host(part)
                    part.state = Residency.NVME
                    self.evictions += 1
                else:
                    part.state = before
                self._drive(part)
        finally:
            done._chunk_done(error)

    def _start_eviction(self, part: Partition) -> IOFuture:
        part.prefetched = False
        if part.dirty:
            return self._start_write(part, free_after=True)
        self._free_host(part)
        part.state = Residency.NVME
        self.evictions += 1
        fut = IOFuture(0, 1)
        fut._chunk_done(None)
        return fut

    def _to_device(self, part: Partition) -> None:
        assert part.host is not None
        self._make_device_room(part)
        self._charge_device(part)
        if self.mover.copies:
            part.device_data, part.ready_event = self.mover.to_device(part.host.tensor())
        part.state = Residency.DEVICE

    def _demote_to_host(self, part: Partition) -> None:
        if part.state is not Residency.DEVICE:
            return
        self._drop_device(part)
        part.state = Residency.HOST

    def _drop_device(self, part: Partition) -> None:
        if part.state.on_device:
            self.ledger.sub("device", part.size)
        part.device_data = None
        part.ready_event = None

    def _charge_device(self, part: Partition) -> None:
        self.ledger.add("device", part.size, f"partition {part.name!r}")

    def _make_device_room(self, part: Partition) -> None:
        budget = self.ledger.budget["device"]
        if budget is None:
            return
        if part.size > budget:
            raise BudgetError(f"partition {part.name!r} needs {format_size(part.size)} on the device, more than "
                              f"memory.device_budget ({format_size(budget)}); raise the budget or use smaller units")
        idle = sorted((p for p in self.partitions.values() if p.state is Residency.DEVICE and not p.users
                       and p.home is not Tier.DEVICE and p is not part), key=lambda p: p.last_used)
        while self.ledger.now("device") + part.size > budget and idle:
            self._demote_to_host(idle.pop(0))
        if self.ledger.now("device") + part.size > budget:
            raise BudgetError(
                f"partition {part.name!r} ({format_size(part.size)}) does not fit memory.device_budget "
                f"({format_size(budget)}): {format_size(self.ledger.now('device'))} is held by partitions in use; "
                "release them first or raise the budget"
            )

    # -- host memory --------------------------------------------------------------------------------
    def _free_host(self, part: Partition) -> None:
        if part.host is not None:
            self.pool.free(part.host)
            self.ledger.sub("host", part.size)
            part.host = None

    def _alloc_host(self, part: Partition, *, wait: bool = True) -> PoolBuffer:
        """A host buffer for `part`, evicting LRU idle NVMe partitions (and waiting for write-backs)."""
        budget = self.pool.nbytes
        if part.size > budget:
            raise BudgetError(
                f"partition {part.name!r} needs {format_size(part.size)} of host memory, more than the whole "
                f"{self.budget_text}; raise memory.host_budget or split the model into "
                "smaller units"
            )
        while True:
            with self._lock:
                try:
                    return self.pool.alloc(part.size, from_top=part.home is not Tier.NVME or part.pinned)
                except BudgetError:
                    pass
                victims = sorted((p for p in self.partitions.values() if p.home is Tier.NVME and p is not part
                                  and p.state in (Residency.HOST, Residency.DEVICE) and not p.users
                                  and not p.waiters), key=self._eviction_key)
                if victims:
                    self._demote_to_host(victims[0])  # a prefetched partition nobody acquired yet
                    wait_for = self._start_eviction(victims[0])
                else:
                    busy = [p for p in self.partitions.values() if p.pending is not None]
                    if not busy:
                        held = [p.name for p in self.partitions.values() if p.host is not None]
                        raise BudgetError(
                            f"partition {part.name!r} needs {format_size(part.size)} of host memory but "
                            f"{self.budget_text} is held by partitions in use or homed on "
                            f"host ({', '.join(held[:8])}{'...' if len(held) > 8 else ''}); release some, or "
                            "raise memory.host_budget"
                        )
                    wait_for = busy[0].pending  # type: ignore[assignment]
                if not wait and not wait_for.done():
                    raise BudgetError(f"no host memory free now for partition {part.name!r}")
            try:
                wait_for.wait()  # without the lock: the completion needs it
            except Exception as exc:  # a failed write-back keeps its data; report it to this caller
                raise StoreError(f"could not free host memory for partition {part.name!r}: {exc}") from exc

    def _eviction_key(self, part: Partition) -> tuple[bool, bool, float, int]:
        """Sort key of eviction candidates: pinned ones last, then prefetched-and-not-yet-used ones; among
        the rest the one needed last first, then the least recently used."""
        later = -self.next_use(part) if self.next_use is not None else 0.0
        return (part.pinned, part.prefetched, later, part.last_used)

    # -- reporting and teardown ---------------------------------------------------------------------
    def stats(self) -> SwapStats:
        with self._lock:
            snap = self.ledger.snapshot()
            snap.now["nvme"] = self._store.used if self._store else 0
            snap.peak["nvme"] = self._store.peak if self._store else 0
            return SwapStats(snap, self.bytes_read, self.bytes_written, self.evictions, len(self.partitions))

    def reset_stats(self) -> None:
        with self._lock:
            self.ledger.reset_peaks()
            self.bytes_read = self.bytes_written = self.evictions = 0
            if self._store is not None:
                self._store.peak = self._store.used

    def close(self) -> None:
        """Wait for transfers in flight, then release host memory, swap files and the engine."""
        if self.closed:
            return
        for part in list(self.partitions.values()):
            self.wait_idle(part)
        self.closed = True
        with self._lock:
            for part in self.partitions.values():
                part.host = None
                part.device_data = None
            self.partitions.clear()
        if self._store is not None:
            self._store.close()
        if self._engine is not None and self._own_engine:
            self._engine.close()
        self.pool.close()

    def __enter__(self) -> TensorSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
