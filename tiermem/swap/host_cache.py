"""The host cache: one pool of host memory for every partition, NVMe reads into it, write-back and eviction.

# [Note: host budget]
All host memory for partitions comes from one HostBufferPool of memory.host_budget bytes, allocated
once; saved activations (activations.tier: nvme) are partitions too, and hold at most activations.buffer
of it (runtime/activations.py), in an arena of their own at the bottom of the pool: they come and go by
the hundred per step, and mixed in with the rest they would split the room a unit's optimizer state needs
in one piece. The other partitions share the rest: those not homed on NVMe, and those kept resident
(`keep_resident`), from the top, the ones that come and go from the bottom. When a fetch needs room, the
idle partitions of its arena whose home is NVMe are evicted (`alloc`, in `_eviction_key`'s order): the
one needed last first (the runtime knows the schedule; else the least recently used), those fetched ahead
and not used yet only after the others, those kept resident last of all. A clean
one is dropped at once, a dirty one written back first. A partition larger than the whole budget, or a
budget full of partitions in use, raises BudgetError naming them.

# [Note: host pool compaction]
The pieces homed on the host (gradient accumulators with grads.tier cpu, partitions of params.tier cpu)
are never evicted, and they come and go at their own pace: accumulators are allocated during backward,
between the parameters being read then, and given back one unit at a time as the next forward applies
the lazy update. So they end up scattered, and a large unit's optimizer state can find the free bytes it
needs only in pieces between them (GPT-2's embedding: 49 MiB of state, 131 MiB free in pieces of at most
27 MiB between 349 MiB of accumulators in a 480 MiB pool). When a fetch that must wait finds no piece
large enough while enough bytes are free, it moves idle pieces instead of failing: `plan_moves`
(tiermem/freelist.py) picks the run of free and idle pieces, side by side, that frees the size by moving
the fewest bytes into holes outside it, and each piece's bytes are copied there (`Partition.move_host`). An
idle piece is one with no user, no transfer and no device copy over its host buffer, so nothing points
into the bytes that move. A copy in memory costs a fraction of the read that evicting a partition and
reading it back would, so it is tried before the first eviction, and once more when nothing is left to
evict (planning takes milliseconds over thousands of pieces, so not before every eviction). Read-aheads
(which must not wait) move nothing, but for the optimizer state and accumulators of an update to come
(`prefetch(compact=True)`): a state read waited for at the start of a forward costs more than the copy,
and the accumulators scatter its room ([Note: the state before step()] in tiermem/runtime/runtime.py).
`stats()` counts the bytes moved.

# [Note: swapper locking]
One re-entrant lock (the swapper's) guards all partition states, the pool and the ledger. Completions of
NVMe transfers arrive on the engine's thread and take the same lock to advance the partition's host state;
they never touch device memory. Nothing waits for I/O while holding the lock: a caller that must wait
(for an eviction's write-back to free host memory, or for its own fetch) waits on a future after letting go
of it, so waiting on one partition never stalls transfers of the others. The one wait under the lock is
`fill`'s copy of a partition homed on the device back to the host, a device copy, not I/O.

# [Note: reads in order]
NVMe reads start in the order they are asked for, and one starts only while the reads in flight hold
less than a queue's worth (io.queue_depth x io.block_size bytes) between them; the rest wait in a FIFO
and start from the completions of those ahead. Given the whole queue at once, two unit reads share the
drive and finish together, so the first one's compute starts only when the second is in too, and the
drive idles while it runs (no buffer is free for a third until the first is released). In order, the
first finishes in half the time, its compute runs while the second reads, and the read its release
allows is queued behind the second, so the drive goes from one read to the next without a gap. Reads of
less than a queue's worth still go several at a time, which small partitions need to keep the queue full.
What callers wait on (`Partition.pending`) completes after `_read_done` has recorded the read, whenever
it started. Writes are not held back: write-backs free the memory that later reads go into.

# [Note: parked read-aheads]
A read-ahead never waits: when the pool has no room for it, it starts the write-back of a dirty partition
needed after it and gives up. Asked again only when the next unit is entered, it found that room free long
after the write had ended: with the lazy update, each unit's optimizer state is written back after its
update, and the next unit's state, which could have gone into that room while the unit computed, was read
only when its own update began, and waited (25 ms of each early unit's forward on the training bench). So
the runtime's read-aheads are parked instead (`TensorSwapper.prefetch(park=True)`), and a write-back that
frees host memory starts them, on the engine's thread, in the order they were asked for, while the room
free now holds the first. They take free room only: making room would evict, and eviction may drop a
device copy, which the engine's thread never touches. A fetch finding room comes first: while one is in
`alloc` in the same arena (an eviction it made frees room it will take when it has the lock again), a
completion starts nothing there (`allocating`, per arena: saved activations come and go in their own
arena all through a forward), and a parked partition that a fetch is bringing in (it has waiters) is
dropped from the list.
Each round of read-aheads (`Runtime._prefetch`) forgets the parked ones of the last round, since the
window has moved.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiermem.config import Config
from tiermem.errors import BudgetError, CorruptDataError, StateError, StoreError
from tiermem.freelist import plan_moves
from tiermem.interrupts import deferred_interrupts
from tiermem.io.backends import create_engine
from tiermem.io.bandwidth import path_weights
from tiermem.io.buffers import HostBufferPool, PoolBuffer, align_up
from tiermem.io.engine import IOEngine, Piece
from tiermem.io.future import IOFuture
from tiermem.sizes import format_size
from tiermem.store import SwapStore
from tiermem.swap.ledger import Ledger
from tiermem.swap.partition import Partition
from tiermem.swap.state import DeviceState, HostState, Tier

if TYPE_CHECKING:
    from tiermem.swap.transfers import DeviceMover
    from tiermem.trace import Tracer

log = logging.getLogger(__name__)


def done_future() -> IOFuture:
    fut = IOFuture(0, 1)
    fut._chunk_done(None)
    return fut


def room_needed(sizes: list[int]) -> int:
    """Bytes of an arena that let first-fit place pieces of `sizes`, taken in this order and all held
    together, wherever the arena's other pieces happened to be; see [Note: host budget].

    Everything else in the arena is evictable, so in the worst case the pieces already held are all that
    is left, and m - 1 held pieces split the free bytes into at most m holes: the m-th piece surely fits
    once the free bytes reach m times its size. Taking the largest piece first needs the least.
    """
    need = held = 0
    for m, size in enumerate(sizes, 1):
        need = max(need, held + m * size)
        held += size
    return need


class HostCache:
    """Host buffers of partitions: allocation with eviction, NVMe reads and writes; see [Note: host budget]."""

    def __init__(self, config: Config, lock: threading.RLock, partitions: dict[str, Partition], ledger: Ledger,
                 pool: HostBufferPool, mover: DeviceMover, engine: IOEngine | None) -> None:
        self.config = config  # the io.*, nvme.* and activations.* settings
        self.lock = lock  # the swapper's: see [Note: swapper locking]
        self.partitions = partitions  # the swapper's, by name
        self.ledger = ledger  # the swapper's: host bytes are charged as partitions take buffers
        self.pool = pool  # all host memory for partitions; see [Note: host budget]
        self.mover = mover  # copies a partition homed on the device back to the host; its device says whether to pin
        self._engine = engine  # made on first NVMe use unless given
        self.own_engine = engine is None  # close it on close() only if we made it
        # Registering the pool with the engine faults in (and pins) every page of it at once; `tiered_offload`
        # defers that until the model's own parameters are in their partitions and freed, so the two never add up.
        self.defer_registration = False
        self._pool_registered = False  # register_pool has handed the pool to the engine made here
        self._store: SwapStore | None = None  # made on first NVMe use
        self.bytes_read = 0  # counters for TensorSwapper.stats(), since its last reset
        self.bytes_written = 0
        self.evictions = 0
        self.bytes_moved = 0  # copied within the pool to join free pieces ([Note: host pool compaction])
        self.tracer: Tracer | None = None  # records each read and write (see [Note: traces])
        # Optional: how soon a partition is needed again (larger = later). With it, eviction drops the
        # partition needed last; without it, the least recently used.
        self.next_use: Callable[[Partition], float] | None = None
        # Called (lock held, on the engine's thread) when a read has brought a partition's bytes in
        self.on_read: Callable[[Partition], None] | None = None
        # Called (lock held, on the engine's thread) when a write-back has freed host memory: the swapper
        # starts the read-aheads that found no room ([Note: parked read-aheads])
        self.on_room: Callable[[], None] | None = None
        # fetches finding room now (in `alloc`), per arena: the room freed there is theirs first
        self.allocating: collections.Counter[str] = collections.Counter()
        # [Note: reads in order]: bytes of the reads in flight, and the reads waiting their turn
        self._reading = 0
        self._queued_reads: collections.deque[tuple[Partition, PoolBuffer, IOFuture]] = collections.deque()

    @property
    def partition_budget(self) -> int:
        """The pool less what saved activations may hold of it (activations.buffer, with activations.tier nvme)."""
        return self.pool.arena_bytes["main"]

    @property
    def budget_text(self) -> str:
        """The host budget partitions share, as error messages name it."""
        size = format_size(self.partition_budget)
        if self.config.activations.host_bytes:
            return f"memory.host_budget less activations.buffer ({size})"
        return f"memory.host_budget ({size})"

    def arena_text(self, arena: str) -> str:
        """What the user sets to size `arena`, as error messages name it."""
        if arena == "activations":
            return f"activations.buffer ({format_size(self.pool.arena_bytes[arena])})"
        return self.budget_text

    @property
    def read_window(self) -> int:
        """Bytes of reads in flight at most, a lone larger read aside: a queue's worth ([Note: reads in order])."""
        return self.engine.queue_depth * self.engine.block_size

    # -- NVMe resources, made lazily so host-only configs never touch a disk --------------------------
    @property
    def engine(self) -> IOEngine:
        with self.lock:
            if self._engine is None:
                io = self.config.io
                self._engine = create_engine(io.engine, block_size=io.block_size, queue_depth=io.queue_depth,
                                             sqpoll=io.sqpoll)
                if not self.defer_registration:
                    self.register_pool()
            return self._engine

    def register_pool(self) -> None:
        """Pin the pool for the device's copies (CUDA only) and register it with the engine made here; once."""
        with self.lock:
            self.defer_registration = False
            engine = None
            if self._engine is not None and self.own_engine and not self._pool_registered:
                self._pool_registered = True
                engine = self._engine
        # not under the lock: the engine's thread may need it to finish a write first (_write_done)
        if self.mover.device.type == "cuda":
            self.pool.pin()  # idempotent; on failure it warns and copies stay synchronous
        if engine is not None:
            engine.register_buffers(self.pool.regions)

    @property
    def store(self) -> SwapStore:
        with self.lock:
            if self._store is None:
                io, nv = self.config.io, self.config.nvme
                weights, _ = path_weights(nv.paths, nv.path_weights)  # entry settled "auto" already
                self._store = SwapStore(list(nv.paths), self.engine, stripe_size=nv.stripe_size, weights=weights,
                                        keep_files=nv.keep_files, direct=io.direct)
            return self._store

    @property
    def store_if_open(self) -> SwapStore | None:
        return self._store

    # -- filling a host buffer (lock held) ------------------------------------------------------------
    def fill(self, part: Partition, buf: PoolBuffer) -> None:
        """Give `part` (host state NONE) the buffer and start bringing its bytes into it."""
        if part.discarded:  # nothing to read: the contents are zeros, or whatever the buffer holds (discard)
            part.attach_host(buf, self.ledger)
            if part.zero_on_fill:
                buf.tensor().zero_()
            part.discarded = False
            part.mark_dirty()
        elif part.device_state is DeviceState.READY and part.device_data is not None:
            part.attach_host(buf, self.ledger)  # home device: the device copy is the one to copy from
            began = self.tracer.now() if self.tracer is not None else 0.0
            self.mover.synchronize(self.mover.to_host(part.device_data, buf.tensor()))
            if self.tracer is not None and self.mover.has_own_memory:
                self.tracer.copy("host", part.name, began, part.size)
        else:
            assert part.extent is not None
            with deferred_interrupts():  # the state says "reading" only once the read is queued
                done = IOFuture(part.size, 1)  # completes once _read_done has recorded the read
                if self._reading and self._reading + part.size > self.read_window:
                    self._queued_reads.append((part, buf, done))  # [Note: reads in order]
                    part.attach_host(buf, self.ledger, HostState.READING)
                    part.pending = done
                else:
                    self._start_read(part, buf, done, attach=True)  # raises before any change
        self.complete_waiters(part)

    def _start_read(self, part: Partition, buf: PoolBuffer, done: IOFuture, *, attach: bool) -> None:
        """Submit the read of `part` into `buf` (lock held); raises before any change. `attach`: give `part`
        the buffer once the read is submitted (a queued read has it already)."""
        assert part.extent is not None
        tracer = self.tracer  # the trace recording when the read starts gets its span
        began = tracer.now() if tracer is not None else 0.0
        fut = self.store.read(part.extent, buf.view, part.size)
        pieces = self.store.pieces(part.extent, part.size) if tracer is not None else []  # its spans
        if attach:
            part.attach_host(buf, self.ledger, HostState.READING)
            part.pending = done
        self._reading += part.size
        fut.add_done_callback(lambda f: self._read_done(part, f, done, tracer, began, pieces))

    def _start_queued_reads(self) -> None:
        """Start the reads waiting their turn while the window has room (lock held, engine's thread)."""
        while self._queued_reads and (not self._reading or
                                      self._reading + self._queued_reads[0][0].size <= self.read_window):
            part, buf, done = self._queued_reads.popleft()
            try:
                self._start_read(part, buf, done, attach=False)
            except Exception as exc:  # noqa: BLE001 - the store closed or refused: that read fails
                self._read_failed(part, exc)
                done._chunk_done(exc)

    def _read_done(self, part: Partition, fut: IOFuture, done: IOFuture, tracer: Tracer | None = None,
                   began: float = 0.0, pieces: list[Piece] | None = None) -> None:
        if tracer is not None:
            tracer.transfer("read", part.name, began, pieces or [], ok=fut.exception() is None)
        error: BaseException | None = None
        try:
            with self.lock:
                self._reading -= part.size
                try:
                    error = self._record_read(part, fut, tracer)
                finally:
                    self._start_queued_reads()
        finally:
            done._chunk_done(error)

    def _record_read(self, part: Partition, fut: IOFuture, tracer: Tracer | None) -> BaseException | None:
        """Advance `part` after its read (lock held); return the error its waiters got, or None."""
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
        if isinstance(error, OSError):  # the drive's own error, with the partition it cost
            wrapped = StoreError(f"reading partition {part.name!r} from swap failed: {error}; its NVMe copy is "
                                 "intact as far as tiermem knows, so a retry may succeed. Check the drive "
                                 "(dmesg, smartctl)")
            wrapped.__cause__ = error
            error = wrapped
        if error is not None:
            self._read_failed(part, error)
            return error
        self.bytes_read += part.size
        if tracer is not None:
            tracer.held(self.ledger, self._store)
        part.read_done()
        if self.on_read is not None:
            self.on_read(part)
        self.complete_waiters(part)
        return None

    def _read_failed(self, part: Partition, error: BaseException) -> None:
        """A read that failed (or could not start): drop the buffer and hand the error to the waiters."""
        part.pending = None
        part.detach_host(self.pool, self.ledger)
        part.want_device = False
        waiters, part.waiters = part.waiters, []
        for f in waiters:
            f._chunk_done(error)

    def complete_waiters(self, part: Partition) -> None:
        if part.reached(Tier.HOST) and part.waiters:
            waiters, part.waiters = part.waiters, []
            for f in waiters:
                f._chunk_done(None)

    # -- writing back (lock held) ---------------------------------------------------------------------
    def start_write(self, part: Partition, *, free_after: bool) -> IOFuture:
        assert part.extent is not None and part.host is not None and part.host_state is HostState.READY
        checksum = zlib.crc32(part.host.view[: part.nbytes]) if self.config.nvme.checksum else None
        with deferred_interrupts():  # the state says "writing" only once the write is queued
            nbytes = min(part.size, align_up(part.dirty_end)) if part.dirty else part.size
            tracer = self.tracer
            began = tracer.now() if tracer is not None else 0.0
            raw = self.store.write(part.extent, part.host.view, nbytes)  # raises before any change
            pieces = self.store.pieces(part.extent, nbytes) if tracer is not None else []  # its spans
            if checksum is not None:
                part.checksum = checksum
            part.write_started()
            part.free_after_write = free_after
            part.written_version = part.version
            # what callers wait on completes after _write_done has recorded the write, not when the bytes land
            done = IOFuture(raw.nbytes, 1)
            part.pending = done
            raw.add_done_callback(lambda f: self._write_done(part, f, done, tracer, began, pieces))
        return done

    def _write_done(self, part: Partition, fut: IOFuture, done: IOFuture, tracer: Tracer | None = None,
                    began: float = 0.0, pieces: list[Piece] | None = None) -> None:
        error = fut.exception()
        if tracer is not None:
            tracer.transfer("write", part.name, began, pieces or [], ok=error is None)
        try:
            with self.lock:
                part.pending = None
                part.write_done()
                if error is not None:  # the host copy is still there and still dirty: nothing is lost
                    # logged as a string: the error object, once raised to waiters, holds their frames
                    log.error("write-back of partition %r failed: %s", part.name, str(error))
                    return
                self.bytes_written += fut.nbytes
                if tracer is not None:
                    tracer.held(self.ledger, self._store)
                if part.version == part.written_version:  # else it changed while the write was in flight
                    part.mark_clean()
                if (part.free_after_write and not part.waiters and not part.users and not part.dirty
                        and part.device_state is DeviceState.NONE):
                    part.detach_host(self.pool, self.ledger)
                    self.evictions += 1
                    if self.on_room is not None:
                        self.on_room()
        finally:
            done._chunk_done(error)

    def start_eviction(self, part: Partition) -> IOFuture:
        """Write back (if dirty) and drop the host copy of an idle NVMe partition with no device copy."""
        part.prefetched = False
        if part.dirty:
            return self.start_write(part, free_after=True)
        part.detach_host(self.pool, self.ledger)
        self.evictions += 1
        return done_future()

    # -- host memory ----------------------------------------------------------------------------------
    def alloc(self, part: Partition, *, wait: bool = True, compact: bool = False) -> PoolBuffer:
        """A host buffer for `part`, evicting idle NVMe partitions (and waiting for write-backs). Lock not held.

        From the partition's arena; a saved activation that finds its arena full of activations in use
        (backward can hold more at once than activations.buffer) overflows into the rest of the pool.
        `compact`: without `wait`, still move idle pieces as a fetch that waits does ([Note: host pool compaction])."""
        arenas = [part.arena]  # the arenas it looks for room in: the room it frees there is its own
        with self.lock:
            self.allocating[part.arena] += 1  # parked read-aheads wait ([Note: parked read-aheads])
        try:
            return self._alloc(part, wait, arenas, compact)
        finally:
            with self.lock:
                for arena in arenas:
                    self.allocating[arena] -= 1

    def _alloc(self, part: Partition, wait: bool, arenas: list[str], compact: bool = False) -> PoolBuffer:
        arena = part.arena
        if part.size > self.pool.arena_bytes[arena]:
            if arena != "activations":
                raise BudgetError(
                    f"partition {part.name!r} needs {format_size(part.size)} of host memory, more than the whole "
                    f"{self.arena_text(arena)}; raise it or split the model into smaller units"
                )
            arena = self._overflow(arenas)
        compacted = False  # moving pieces is tried once before the evictions, and last of all
        while True:
            with self.lock:
                try:
                    return self.pool.alloc(part.size, from_top=part.home is not Tier.NVME or part.resident, arena=arena)
                except BudgetError:
                    pass
                if (wait or compact) and not compacted:
                    compacted = True
                    if self._compact(part.size, arena):
                        continue
                victims = sorted((p for p in self.partitions.values() if p.home is Tier.NVME and p is not part
                                  and p.host is not None and p.host.arena == arena
                                  and p.host_state is HostState.READY and p.device_state is not DeviceState.COPYING
                                  and not p.users and not p.waiters), key=self._eviction_key)
                if not wait:  # a read ahead makes room only from what is needed after it, never from kept units
                    victims = [p for p in victims if not p.resident and self._needed_after(p, part)]
                busy = [p for p in self.partitions.values() if p.pending is not None and p.host is not None
                        and p.host.arena == arena]
                if victims:
                    victims[0].drop_device(self.ledger)  # a prefetched partition nobody acquired yet
                    victims[0].want_device = False
                    wait_for = self.start_eviction(victims[0])
                elif busy:
                    wait_for = busy[0].pending  # type: ignore[assignment]
                elif arena == "activations":
                    arena = self._overflow(arenas)  # see the docstring
                    continue
                elif (wait or compact) and self._compact(part.size, arena):  # with nothing left to evict
                    continue
                else:
                    raise self._no_room(part, arena)
                if not wait and not wait_for.done():
                    raise BudgetError(f"no host memory free now for partition {part.name!r}")
            try:
                wait_for.wait()  # without the lock: the completion needs it
            except Exception as exc:  # a failed write-back keeps its data; report it to this caller
                raise StoreError(f"could not free host memory for partition {part.name!r}: {exc}") from exc

    def _overflow(self, arenas: list[str]) -> str:
        """A saved activation's fetch goes on in the main arena, which then counts it as finding room there."""
        with self.lock:
            self.allocating["main"] += 1
            arenas.append("main")
        return "main"

    def _compact(self, size: int, arena: str) -> bool:
        """Move idle pieces of `arena` so that `size` bytes are free in one piece, if enough are free and a way
        is found; whether it did (lock held). See [Note: host pool compaction]."""
        holes = self.pool.holes(arena)
        if sum(n for _, n in holes) < align_up(size):
            return False
        idle = {p.host.offset: (p, p.host) for p in self.partitions.values()
                if p.movable and p.host is not None and p.host.arena == arena == p.arena}
        plan = plan_moves(holes, [(off, held.nbytes) for off, (_, held) in idle.items()], align_up(size))
        if not plan:  # None: no way found; []: a piece fits already, so nothing here can help
            return False
        for src, dest in plan:
            part, held = idle[src]
            buf = self.pool.alloc_at(dest, held.nbytes, arena)
            if buf is None:  # the plan's holes are the pool's own, taken under the lock: cannot happen
                raise StateError(f"host pool compaction: {format_size(held.nbytes)} at offset {dest} is not free")
            self.pool.free(part.move_host(buf))
            self.bytes_moved += buf.nbytes
        log.debug("host pool: moved %d pieces to free %s in one piece", len(plan), format_size(size))
        return True

    def _no_room(self, part: Partition, arena: str) -> BudgetError:
        held = [p for p in self.partitions.values() if p.host is not None and p.host.arena == arena]
        free = self.pool.arena_bytes[arena] - sum(p.size for p in held)
        split = (f" ({format_size(free)} is free, but in pieces of at most "
                 f"{format_size(self.pool.largest_free(arena))})" if free >= part.size else "")
        names = ", ".join(p.name for p in held[:8]) + ("..." if len(held) > 8 else "")
        return BudgetError(
            f"partition {part.name!r} needs {format_size(part.size)} of host memory but {self.arena_text(arena)} "
            f"is held by partitions in use or homed on host ({names}){split}; release some, or raise it"
        )

    def _needed_after(self, p: Partition, part: Partition) -> bool:
        """True when `p` is next needed later than `part`, or `part` is needed now or the order says nothing of
        it (no order yet, or a partition outside it: a saved activation)."""
        if self.next_use is None:
            return True
        need = self.next_use(part)
        return need in (0.0, math.inf) or self.next_use(p) > need

    def _eviction_key(self, part: Partition) -> tuple[bool, bool, float, int]:
        """Sort key of eviction candidates: resident ones last, then prefetched-and-not-yet-used ones; among
        the rest the one needed last first, then the least recently used."""
        later = -self.next_use(part) if self.next_use is not None else 0.0
        return (part.resident, part.prefetched, later, part.last_used)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        if self._engine is not None and self.own_engine:
            self._engine.close()
        self.pool.close()
