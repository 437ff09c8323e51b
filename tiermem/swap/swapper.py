"""TensorSwapper: the public face of the swapper. It owns every partition and moves partitions between the
device, the host cache (host_cache.py) and NVMe; device copies go through a mover (transfers.py).

See [Note: residency] in state.py for the states, [Note: host budget] and [Note: swapper locking] in
host_cache.py for host memory and threads, and [Note: device budget] below.

# [Note: device budget]
With memory.device_budget set, the device ledger refuses to go over it: acquiring a partition first
demotes idle device copies (least recently used first, those fetched ahead for the window last), and
raises BudgetError naming the setting when the partitions in use leave no room. With null, the runtime
derives a cap from the prefetch settings (`derive_device_cap`): prefetches stay under it, so the device
holds the units in use plus the window; only acquisitions themselves (a model whose modules nest more
units than the cap foresaw) may go past it. With several ranks the units gathered whole count on the
ledger too (the one computing and the next one's gather in flight). A prefetch never demotes a partition
fetched ahead and not yet used: when there is no room it is skipped.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.config import Config, load_config
from tiermem.device import resolve_device
from tiermem.errors import BudgetError, CorruptDataError, StateError, StoreError
from tiermem.io.buffers import HostBufferPool
from tiermem.io.engine import IOEngine
from tiermem.io.future import IOFuture
from tiermem.sizes import format_size
from tiermem.store import SwapStore
from tiermem.swap.host_cache import HostCache, done_future
from tiermem.swap.layout import Layout
from tiermem.swap.ledger import Ledger, LedgerSnapshot
from tiermem.swap.partition import Partition
from tiermem.swap.state import DeviceState, HostState, Tier
from tiermem.swap.transfers import make_mover

log = logging.getLogger(__name__)

__all__ = ["CorruptDataError", "SwapStats", "TensorSwapper"]

TIERS = (Tier.HOST, Tier.DEVICE)  # the tiers a partition is brought to and held in


@dataclass(frozen=True)
class SwapStats:
    """Counters since the last reset, and the ledger (bytes per tier now and at peak)."""

    ledger: LedgerSnapshot
    bytes_read: int
    bytes_written: int
    evictions: int
    partitions: int
    bytes_moved: int = 0  # copied within the host pool to join free pieces ([Note: host pool compaction])


class _DeviceFetch(IOFuture):
    """A fetch to the device: the host read, then the copy to the device made by whoever waits (the compute
    thread; see [Note: device copies] in transfers.py)."""

    def __init__(self, swapper: TensorSwapper, part: Partition, host: IOFuture) -> None:
        super().__init__(part.size, 1)
        self._swapper = swapper
        self._part = part
        self._host = host

    def done(self) -> bool:
        return self._part.reached(Tier.DEVICE) or super().done()

    def wait(self, timeout: float | None = None) -> int:
        if not super().done():
            try:
                self._host.wait(timeout)
                self._swapper._to_device(self._part, prefetch=False)
            except BaseException as exc:
                self._chunk_done(exc)
                raise
            self._chunk_done(None)
        return super().wait(timeout)


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
        self.mover = make_mover(self.device)  # device copies: none on the CPU, a side stream on CUDA
        self._lock = threading.RLock()  # see [Note: swapper locking] in host_cache.py
        self._clock = 0  # advances on every fetch/release; orders LRU eviction
        self.partitions: dict[str, Partition] = {}  # by name, in insertion order
        self.ledger = Ledger(host_budget=None, device_budget=cfg.memory.device_budget)
        # every partition's host bytes come from here; the activations' buffer is the budget's other part
        try:
            pool = HostBufferPool(cfg.memory.host_budget)  # one cache for every partition, saved activations too
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            raise BudgetError(f"memory.host_budget ({format_size(cfg.memory.host_budget)}) cannot be mapped: "
                              f"{exc.strerror}; lower memory.host_budget or raise this process's memory limit "
                              "(ulimit -v, the container's limit, vm.overcommit_memory)") from None
        if cfg.activations.host_bytes:  # saved activations come and go by the hundred: their own arena
            pool.add_arena("activations", cfg.activations.host_bytes)
        self.ledger.budget["host"] = pool.nbytes
        self.cache = HostCache(cfg, self._lock, self.partitions, self.ledger, pool, self.mover, engine)
        self.device_cap: int | None = cfg.memory.device_budget  # explicit, or derived by the runtime
        self._want_device: dict[str, Partition] = {}  # prefetched to the device, waiting for their host bytes
        if not self.mover.has_own_memory:
            self.cache.on_read = self._read_to_shared_device
        # read-aheads that found no room, started by the write-back that frees it ([Note: parked read-aheads])
        self._parked: list[tuple[Partition, Tier]] = []
        self.cache.on_room = self._start_parked
        self.closed = False

    # -- what the rest of tiermem asks ------------------------------------------------------------------
    @property
    def pool(self) -> HostBufferPool:
        return self.cache.pool

    @property
    def engine(self) -> IOEngine:
        """The I/O engine (io.* settings), made on first use; the host pool is registered with it."""
        return self.cache.engine

    @property
    def store(self) -> SwapStore:
        return self.cache.store

    @property
    def budget_text(self) -> str:
        return self.cache.budget_text

    @property
    def partition_budget(self) -> int:
        """Host bytes for partitions other than saved activations (which may hold activations.buffer)."""
        return self.cache.partition_budget

    @property
    def defer_registration(self) -> bool:
        return self.cache.defer_registration

    @defer_registration.setter
    def defer_registration(self, value: bool) -> None:
        self.cache.defer_registration = value

    def register_pool(self) -> None:
        """Pin (CUDA) and register the host pool with the engine this swapper made, once."""
        self.cache.register_pool()

    def evict_by_next_use(self, next_use: Callable[[Partition], float]) -> None:
        """From now on, when host memory runs short, write back first the partition needed furthest ahead:
        `next_use(part)` is how many acquisitions away its next use is (1 for the next, inf for never, 0 for
        needed now). Until it is called (and while `next_use` returns 0 for all, before an order is known), the
        least recently used goes first."""
        self.cache.next_use = next_use

    def is_on_the_way(self, part: Partition, tier: Tier = Tier.DEVICE) -> bool:
        """Whether `part` is usable in `tier` now, or a transfer toward it has started."""
        with self._lock:
            if tier == Tier.DEVICE:
                return part.device_state is not DeviceState.NONE or part.want_device
            return part.host_state is not HostState.NONE

    def holds_host(self, part: Partition) -> bool:
        """Whether `part` holds host memory now (its bytes there, or being read into it)."""
        with self._lock:
            return part.host_state is not HostState.NONE

    def host_bytes_in(self, arena: str) -> int:
        """Host bytes that partitions of `arena` hold now (those that `holds_host`), counted as they come and go."""
        return self.ledger.host_in(arena)

    def owes_write(self, part: Partition) -> bool:
        """Whether `part`'s host copy is newer than its NVMe copy (or it has none yet): a write-back is owed."""
        with self._lock:
            return part.dirty

    @property
    def clock(self) -> int:
        """The LRU clock: a partition fetched or released after a reading of it has a larger `last_used`."""
        return self._clock

    def write_back(self, part: Partition) -> IOFuture:
        """Start writing a dirty NVMe partition's host copy to disk (it stays cached); the future completes
        when it is written."""
        with self._lock:
            if part.home is Tier.NVME and part.dirty and part.host_state is HostState.READY:
                return self.cache.start_write(part, free_after=False)
            return part.pending or done_future()

    def room_to_spare(self, part: Partition, times: int = 1) -> bool:
        """Whether `part`'s host copy can stay for now: no read-ahead is waiting for room, and its arena has
        `times` as many bytes free, one piece of them at least as large as `part`."""
        with self._lock:
            if part.host is None or self._parked:
                return False
            arena = part.host.arena
            free = sum(n for _, n in self.pool.holes(arena))
            return free >= times * part.size and self.pool.largest_free(arena) >= part.size

    def keep_resident(self, part: Partition, keep: bool = True) -> None:
        """Keep `part` in host memory between uses (evicted only when nothing else can be), or stop."""
        with self._lock:
            part.resident = keep

    def derive_device_cap(self, largest_unit: int, window_bytes: int, gathered: int = 0) -> None:
        """Cap the device at what stays there for good, plus two units in use, the window and `gathered` (units
        gathered whole from several ranks, or expanded from compressed storage), when memory.device_budget is
        null (see [Note: device budget])."""
        if self.config.memory.device_budget is None:
            with self._lock:
                fixed = sum(p.size for p in self.partitions.values() if p.home is Tier.DEVICE)
                self.device_cap = fixed + 2 * largest_unit + window_bytes + gathered
        self._check_device_free()

    def _check_device_free(self) -> None:
        """Raise BudgetError, naming the setting, when the device cap is more than the device has free (past
        what the partitions placed there hold already): else it would fail mid-run, out of device memory."""
        free = self.mover.free_bytes()
        cap = self.device_cap
        if free is None or cap is None:
            return
        held = self.ledger.now("device")
        if cap - held <= free:
            return
        if self.config.memory.device_budget is not None:
            what = f"memory.device_budget ({format_size(cap)})"
            fix = f"set memory.device_budget to at most {format_size(free + held)}"
        else:
            what = (f"the device working set derived from the prefetch settings ({format_size(cap)}: two units in "
                    "use, the prefetch window and the units gathered or expanded whole)")
            fix = (f"set memory.device_budget to at most {format_size(free + held)} (it then caps the window), "
                   "lower prefetch.depth or prefetch.max_bytes, or use smaller units (wrap.classes)")
        raise BudgetError(f"{what} is more than {self.device} has free ({format_size(free)}"
                          + (f" besides the {format_size(held)} already placed there" if held else "")
                          + f"); {fix}, or free device memory held elsewhere in this process")

    # -- partitions ---------------------------------------------------------------------------------
    def add(self, name: str, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
            home: str | Tier = Tier.NVME,
            fill: Callable[[dict[str, torch.Tensor]], None] | None = None, zero: bool = False,
            arena: str = "main") -> Partition:
        """Pack `tensors` (copied) into a new partition resting in `home` ('device', 'cpu' or 'nvme').

        With `fill`, `tensors` only give names, dtypes and shapes (meta tensors will do) and
        `fill(views)` writes the data into the partition's host views instead. `zero` clears the whole
        buffer first, padding included (so flat views over it hold zeros between tensors); with `zero`
        and no `fill`, `tensors` only give the layout. An NVMe partition starts on host, dirty, and is
        written out when evicted or on `flush()`; a device one is filled on the host, then copied.
        `arena` names the part of the host pool its host buffer comes from (see [Note: host budget]).
        """
        if self.closed:
            raise StateError("the swapper is closed")
        if self.device.type == "cuda" and not self.defer_registration:
            self.pool.pin()  # for asynchronous copies; tiered_offload pins later, in register_pool
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        try:
            tier = Tier.of(home)
        except ValueError as exc:
            raise ValueError(f"home: {exc}") from None
        with self._lock:
            if name in self.partitions:
                raise ValueError(f"a partition named {name!r} exists already")
        part = Partition(name, Layout.of(items), tier, arena)
        if tier is Tier.NVME:
            part.extent = self.store.allocate(part.size)
        try:
            buf = self.cache.alloc(part)
            with self._lock:
                part.attach_host(buf, self.ledger)
            views = part.tensors(Tier.HOST)
            with torch.no_grad():
                if zero:
                    part.flat(Tier.HOST).zero_()
                if fill is not None:
                    fill(views)
                elif not zero:
                    for slot_name, t in items:
                        views[slot_name].copy_(t.detach())
            if tier is Tier.DEVICE:
                self._to_device(part, prefetch=False)
                if self.mover.has_own_memory:  # the device copy is the partition now: the host one goes
                    with self._lock:
                        part.detach_host(self.pool, self.ledger)
        except BaseException:
            with self._lock:
                part.drop_device(self.ledger)
                part.detach_host(self.pool, self.ledger)
                if part.extent is not None:
                    self.store.free(part.extent)
            raise
        part.mark_dirty()  # no NVMe copy yet
        with self._lock:
            self._clock += 1
            part.last_used = self._clock
            self.partitions[name] = part
        return part

    def remove(self, part: Partition) -> None:
        """Forget a partition and give back its memory and swap space."""
        self.wait_idle(part)
        with self._lock:
            if part.users:
                raise StateError(f"partition {part.name!r} is in use ({part.users} acquire without release)")
            part.drop_device(self.ledger)
            part.detach_host(self.pool, self.ledger)
            if part.extent is not None:
                self.store.free(part.extent)
                part.extent = None
            self._want_device.pop(part.name, None)
            self._parked = [(p, t) for p, t in self._parked if p is not part]
            del self.partitions[part.name]

    # -- moving -------------------------------------------------------------------------------------
    def fetch(self, part: Partition, tier: Tier = Tier.DEVICE, *, wait_for_memory: bool = True) -> IOFuture:
        """Start moving `part` up to `tier` ('host' or 'device'); return a future that completes there.

        The copy to the device is made by the thread that waits on the future (or by `acquire`/`prefetch`
        once the host bytes are in). `wait_for_memory=False` raises BudgetError at once instead of waiting
        for write-backs or reads in flight to free host memory (what a prefetch wants: never stall).
        """
        _check_tier(tier)
        if tier == Tier.DEVICE and part.reached(Tier.DEVICE):
            return done_future()
        host = self._fetch_host(part, wait_for_memory)
        return _DeviceFetch(self, part, host) if tier == Tier.DEVICE else host

    def _fetch_host(self, part: Partition, wait_for_memory: bool, compact: bool = False) -> IOFuture:
        with self._lock:
            self._clock += 1
            part.last_used = self._clock
            fut = IOFuture(part.size, 1)
            if part.reached(Tier.HOST):
                fut._chunk_done(None)
                return fut
            part.waiters.append(fut)
            need_buffer = part.host_state is HostState.NONE
        if need_buffer:
            try:
                buf = self.cache.alloc(part, wait=wait_for_memory, compact=compact)  # may evict, wait for writes
            except BaseException:
                with self._lock:
                    part.waiters = [f for f in part.waiters if f is not fut]
                raise
            with self._lock:
                if part.host_state is not HostState.NONE:
                    self.pool.free(buf)  # another fetch got there first
                    return fut
                try:
                    self.cache.fill(part, buf)
                except BaseException:  # the read could not be queued: nothing is waiting for it
                    if part.host is not buf:
                        self.pool.free(buf)
                    part.waiters = [f for f in part.waiters if f is not fut]
                    raise
        return fut

    def prefetch(self, part: Partition, tier: Tier = Tier.DEVICE, *, park: bool = False,
                 compact: bool = False) -> IOFuture | None:
        """Start a fetch that never blocks: None (nothing started) when host memory is not free now.

        Toward the device, the copy starts now if the host bytes are in, else at the next `acquire` or
        `prefetch` after they arrive; it is skipped when the device has no room (see [Note: device budget]).
        `park`: when there is no room, the read starts once a write-back frees it, unless `forget_parked`
        comes first (see [Note: parked read-aheads]). `compact`: when the bytes are free but in pieces, move
        idle pieces to join them, as a fetch that waits does ([Note: host pool compaction]).
        """
        _check_tier(tier)
        if tier == Tier.DEVICE and part.reached(Tier.DEVICE):
            return done_future()
        try:
            fut = self._fetch_host(part, wait_for_memory=False, compact=compact)
        except BudgetError:
            if park:
                with self._lock:
                    if (part.home is Tier.NVME and part.device_state is DeviceState.NONE
                            and all(p is not part for p, _ in self._parked)):
                        self._parked.append((part, tier))
            return None
        self._mark_prefetched(part, tier)
        self.pump()
        return fut

    def _mark_prefetched(self, part: Partition, tier: Tier) -> None:
        with self._lock:
            part.prefetched = True
            if tier == Tier.DEVICE:
                part.want_device = True
                self._want_device[part.name] = part

    def forget_parked(self) -> None:
        """Drop the parked read-aheads not started yet: the runtime's next round of read-aheads replaces them."""
        with self._lock:
            self._parked.clear()

    def _start_parked(self) -> None:
        """Start parked read-aheads, in the order they were asked for, while the host pool has room for the
        first of them (lock held, the engine's thread; see [Note: parked read-aheads])."""
        while self._parked:
            part, tier = self._parked[0]
            if part.host_state is not HostState.NONE or part.device_state is not DeviceState.NONE or part.waiters:
                self._parked.pop(0)  # fetched meanwhile, or being fetched (a fetch making room for it waits)
                continue
            if self.cache.allocating[part.arena]:
                return  # a fetch is finding room there: what was freed is its own
            try:  # free room only: making room would evict, and that may drop device copies
                buf = self.pool.alloc(part.size, from_top=part.resident, arena=part.arena)
            except BudgetError:
                return
            self._parked.pop(0)
            self._clock += 1
            part.last_used = self._clock
            try:
                self.cache.fill(part, buf)
            except Exception as exc:  # noqa: BLE001 - a read-ahead is a hint: its acquire retries and reports
                if part.host is not buf:
                    self.pool.free(buf)
                log.warning("reading partition %r ahead failed: %s", part.name, str(exc))
                continue
            self._mark_prefetched(part, tier)

    def pump(self) -> None:
        """Start the device copies of prefetched partitions whose host bytes have arrived (compute thread)."""
        with self._lock:
            ready = [p for p in self._want_device.values() if p.has_host_bytes() or not p.want_device]
            for p in ready:
                del self._want_device[p.name]
        for p in ready:
            if p.want_device:
                p.want_device = False
                try:
                    self._to_device(p, prefetch=True)
                except Exception as exc:  # noqa: BLE001 - a prefetch is a hint: the acquire retries and reports
                    log.warning("prefetching partition %r to %s failed: %s", p.name, self.device, str(exc))

    def acquire(self, part: Partition, tier: Tier = Tier.DEVICE,
                before_wait: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
        """Bring `part` to `tier`, wait, mark it in use, and return its tensors there (views).

        `before_wait` runs once `part` is marked in use (so nothing evicts it) and its transfer has
        started, before blocking: the place to start other transfers that should overlap this one.
        """
        _check_tier(tier)
        self.pump()
        fut = None
        with self._lock:
            there = tier == Tier.DEVICE and part.reached(Tier.DEVICE)
            if there:  # held in the same breath, so nothing demotes it in between
                part.holders[tier] += 1
        while not there:
            fut = self._fetch_host(part, True)
            with self._lock:
                part.holders[tier] += 1  # counted before waiting, so eviction cannot take it from under us
                # a write-back that frees the host copy may have ended between the fetch finding the copy and
                # this count (the engine's thread): then fetch again, now that nothing can free it
                there = not fut.done() or part.has_host_bytes() or fut.exception() is not None
                if not there:
                    part.holders[tier] -= 1
        with self._lock:
            part.prefetched = False
        try:
            if before_wait is not None:
                before_wait()
            if fut is not None:
                fut.wait()
            if tier == Tier.DEVICE:
                self._to_device(part, prefetch=False)
        except BaseException:
            with self._lock:
                part.holders[tier] -= 1
            raise
        if tier == Tier.DEVICE and part.device_data is not None:
            self.mover.use_on_compute(part.device_data, part.ready_event)
        return part.tensors(tier)

    def release(self, part: Partition, *, dirty: bool = False, keep: bool = False, tier: Tier | None = None,
                dirty_end: int | None = None) -> None:
        """End one use in `tier` (default: the only tier it is held in). `dirty`: its tensors changed there
        (with `dirty_end`, only in its first that many bytes: a write-back writes no more).

        A change on the device is copied back to the host copy; a change on the host refreshes a device
        copy. When nobody uses it any more, it leaves the device (its home tier permitting) unless `keep`
        (it is needed again soon), and stays on host as a cache until the host budget needs the room.
        """
        self.pump()  # the window's copies start while the released unit's kernels may still run (CUDA)
        with self._lock:
            held = [t for t in TIERS if part.holders[t] > 0]
            if tier is None:
                if len(held) > 1:
                    raise StateError(f"partition {part.name!r} is held in {' and '.join(held)}; say which tier "
                                     "release() ends")
                tier = held[0] if held else Tier.DEVICE
            if part.holders[tier] <= 0:
                raise StateError(f"partition {part.name!r} released more often than acquired (in {tier} memory)")
            device, host = part.device_data, part.host
        if dirty:  # the copy outside the lock: the partition is still held, so nothing moves it meanwhile
            tracer = self.cache.tracer
            began = tracer.now() if tracer is not None else 0.0
            if tier == Tier.DEVICE and device is not None and host is not None:
                self.mover.synchronize(self.mover.to_host(device, host.tensor()))
                if tracer is not None:
                    tracer.copy("host", part.name, began, part.size)
            elif tier == Tier.HOST and device is not None and host is not None:
                part.copying_from_host(self.mover.to_device_into(host.tensor(), device))
                if tracer is not None:
                    tracer.copy("device", part.name, began, part.size)
        with self._lock:
            part.holders[tier] -= 1
            self._clock += 1
            part.last_used = self._clock
            if dirty:
                part.mark_dirty(dirty_end)
                part.version += 1  # a write-back in flight now carries older bytes: it must not clear dirty
            if part.users == 0:
                if part.home is Tier.DEVICE:
                    if part.device_data is not None:  # the device copy is the partition; the host one was a loan
                        part.detach_host(self.pool, self.ledger)
                elif not keep:
                    part.drop_device(self.ledger)

    def demote(self, part: Partition) -> None:
        """Move an idle partition off the device (to host); nothing happens if it is in use or not there."""
        with self._lock:
            if not part.users and part.home is not Tier.DEVICE:
                part.drop_device(self.ledger)
                part.want_device = False

    def evict(self, part: Partition) -> IOFuture:
        """Move an idle partition down to its home tier (writing it back if dirty); return the future."""
        with self._lock:
            if part.users:
                raise StateError(f"partition {part.name!r} is in use; release it before evicting")
            if part.home is not Tier.DEVICE:
                part.drop_device(self.ledger)
                part.want_device = False
            if part.home is not Tier.NVME or part.host_state is not HostState.READY:
                return part.pending or done_future()
            return self.cache.start_eviction(part)

    def flush(self) -> None:
        """Write every dirty NVMe partition on host back to disk (they stay cached) and wait, for the writes
        already in flight (an eviction's write-back) too."""
        for _ in range(2):  # one changed while its write was in flight is dirty again after it: write it then
            writes = []
            with self._lock:
                for part in self.partitions.values():
                    if part.home is not Tier.NVME:
                        continue
                    if part.host_state is HostState.WRITING and part.pending is not None:
                        writes.append((part, part.pending))
                    elif part.dirty and part.host_state is HostState.READY:
                        writes.append((part, self.cache.start_write(part, free_after=False)))
            self._wait_writes(writes)
        store = self.cache.store_if_open
        if store is not None:
            store.flush()

    def evict_idle(self) -> None:
        """Evict every idle NVMe partition (writing back the dirty ones) and wait: the host pool is then as
        empty as it can be, e.g. before placing long-lived partitions so they sit together."""
        with self._lock:
            idle = [p for p in self.partitions.values() if p.home is Tier.NVME and not p.users and not p.waiters
                    and p.host_state is HostState.READY]
        self._wait_writes([(part, self.evict(part)) for part in idle])

    def _wait_writes(self, writes: list[tuple[Partition, IOFuture]]) -> None:
        """Wait for every write; the failed ones raise one StoreError naming their partitions (their host
        copies stay, dirty: nothing is lost, and a later write may succeed)."""
        failed: list[tuple[Partition, BaseException]] = []
        for part, fut in writes:
            try:
                fut.wait()
            except OSError as exc:
                failed.append((part, exc))
        if failed:
            names = ", ".join(p.name for p, _ in failed[:4]) + ("..." if len(failed) > 4 else "")
            raise StoreError(f"writing {len(failed)} partition(s) to swap failed ({names}): {failed[0][1]}; their "
                             "host copies are kept. Check the drive (dmesg, smartctl) and the free space of "
                             "nvme.paths") from failed[0][1]

    def discard(self, part: Partition, *, zeros: bool = True) -> None:
        """Drop the contents of an idle partition and give its memory back, whatever its home tier; nothing is
        written. The next fetch reads nothing and hands out zeros, or with `zeros=False` a buffer as the pool
        has it, for a client that writes every byte it will read (gradient accumulators after an update).
        """
        self.wait_idle(part)
        with self._lock:
            if part.users or part.waiters:
                raise StateError(f"partition {part.name!r} is in use; release it before discarding it")
            part.drop_device(self.ledger)
            part.detach_host(self.pool, self.ledger)
            part.discarded = True
            part.zero_on_fill = zeros
            part.mark_clean()
            part.prefetched = part.want_device = False
            part.checksum = None
            part.version += 1

    def wait_idle(self, part: Partition) -> None:
        """Block until `part` has no NVMe transfer in flight."""
        while True:
            with self._lock:
                pending = part.pending
            if pending is None:
                return
            try:
                pending.wait()
            except Exception:  # noqa: BLE001 - the owner of that transfer reports its error
                pass

    # -- the device (compute thread; see [Note: device copies] in transfers.py) -----------------------
    def _to_device(self, part: Partition, *, prefetch: bool) -> bool:
        """Copy `part`'s host bytes to the device unless it is there; False when a prefetch found no room.

        The device ledger is charged before the memory is allocated (a reservation), and the charge is taken
        back if the allocation or the copy fails; the error goes to the caller.
        """
        with self._lock:
            if part.device_state is DeviceState.READY:
                return True
            if not part.has_host_bytes():
                raise StateError(f"partition {part.name!r} is {part.state.value}; its host bytes are not in")
            if not self._make_device_room(part, prefetch=prefetch):
                return False
            part.reserve_device(self.ledger)
            host = part.host
            assert host is not None
        tracer = self.cache.tracer
        began = tracer.now() if tracer is not None else 0.0
        try:
            data, event = self.mover.to_device(host.tensor()) if self.mover.has_own_memory else (None, None)
            if tracer is not None and data is not None:
                tracer.copy("device", part.name, began, part.size)
        except BaseException:
            with self._lock:
                part.drop_device(self.ledger)
            raise
        with self._lock:
            part.commit_device(data, event)
        return True

    def _read_to_shared_device(self, part: Partition) -> None:
        """On a device whose memory is the host's, a prefetch reaches the device when its read does: no byte
        moves, only the ledger counts it (lock held; the engine's thread may run this)."""
        if part.want_device and part.device_state is DeviceState.NONE and self._make_device_room(part, prefetch=True):
            part.reserve_device(self.ledger)
            part.commit_device(None, None)
        part.want_device = False

    def _make_device_room(self, part: Partition, *, prefetch: bool) -> bool:
        """Demote idle device copies until `part` fits the cap; see [Note: device budget]. Lock held."""
        cap = self.device_cap
        explicit = self.config.memory.device_budget is not None
        if cap is None:
            return True
        if part.size > cap and explicit:
            raise BudgetError(f"partition {part.name!r} needs {format_size(part.size)} on the device, more than "
                              f"memory.device_budget ({format_size(cap)}); raise the budget or use smaller units")
        idle = sorted((p for p in self.partitions.values() if p.device_state is DeviceState.READY and not p.users
                       and p.home is not Tier.DEVICE and p is not part and not (prefetch and p.prefetched)),
                      key=lambda p: (p.prefetched, p.last_used))
        while self.ledger.now("device") + part.size > cap and idle:
            idle.pop(0).drop_device(self.ledger)
        if self.ledger.now("device") + part.size <= cap:
            return True
        if prefetch:
            return False
        if explicit:
            raise BudgetError(
                f"partition {part.name!r} ({format_size(part.size)}) does not fit memory.device_budget "
                f"({format_size(cap)}): {format_size(self.ledger.now('device'))} is held by partitions in use; "
                "release them first or raise the budget"
            )
        return True

    # -- reporting and teardown ---------------------------------------------------------------------
    def stats(self) -> SwapStats:
        with self._lock:
            snap = self.ledger.snapshot()
            store = self.cache.store_if_open
            snap.now["nvme"] = store.used if store else 0
            snap.peak["nvme"] = store.peak if store else 0
            c = self.cache
            return SwapStats(snap, c.bytes_read, c.bytes_written, c.evictions, len(self.partitions), c.bytes_moved)

    def reset_stats(self) -> None:
        with self._lock:
            self.ledger.reset_peaks()
            self.cache.bytes_read = self.cache.bytes_written = self.cache.evictions = self.cache.bytes_moved = 0
            store = self.cache.store_if_open
            if store is not None:
                store.peak = store.used

    def close(self) -> None:
        """Wait for transfers in flight (NVMe and device), then release memory, swap files and the engine."""
        if self.closed:
            return
        for part in list(self.partitions.values()):
            self.wait_idle(part)
        self.mover.close()  # copies on the side stream read or write the pool: they end before it goes
        self.closed = True
        with self._lock:
            for part in self.partitions.values():
                part.forget(self.ledger)
            self.partitions.clear()
            self._want_device.clear()
        self.cache.close()

    def __enter__(self) -> TensorSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_tier(tier: Tier) -> None:
    if tier not in TIERS:
        raise ValueError(f"tier: expected Tier.HOST or Tier.DEVICE, got {tier!r}")
