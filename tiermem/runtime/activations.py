"""Saved activations on NVMe: autograd's saved tensors leave memory in forward and come back for backward.

# [Note: activation offload]
With ``activations.tier: nvme`` the runtime's saved-tensor pack hook hands every saved tensor that is not
a managed parameter (see [Note: backward] in runtime.py) and has at least ``activations.min_bytes`` of
storage to `ActivationStore.pack`. The store is a client of the swapper: each saved storage becomes a
partition homed on NVMe, in the same host cache as parameters and optimizer state (host_cache.py), so
one pool, one eviction policy and one write-back serve them all. Pack copies the tensor's whole storage
into the partition's host buffer (on CUDA on the copy side stream, the write starting once the copy is
done), starts its write, and returns a `_SavedActivation` holding the dtype, size, stride and storage
offset. Autograd drops its reference to the original tensor, so forward's activations are freed as
forward goes instead of piling up until backward.

``activations.buffer`` is the most host memory the activations may hold in the cache at once: when a pack
would pass it, the oldest activations (the ones backward needs last) are dropped from memory, after their
writes when those are still in flight. So when forward ends the newest activations are still in memory,
and they are the ones backward wants first. The rest of the cache evicts activations before parameters
(the schedule knows no next use for them).

# [Note: activation writes deferred]
The activations still in the buffer when forward ends are read by backward from memory; a write of them
would never be read. So once a forward's total is known (from the one before, as for ``activations.keep``),
the records that will be the newest sent, the last ``activations.buffer`` of them, are not written when
packed: their partitions stay dirty in the buffer, and backward uses and removes them without a write. If
this forward saves more than the last one did, the buffer fills before it ends, and dropping the oldest of
those records writes it first (a dirty partition's eviction is its write-back), with the forward waiting
for that write: nothing is lost, the estimate only costs time. The same holds when the rest of the cache
evicts one of them. `activations_unwritten_bytes` counts the records backward found in memory unwritten (at
their first unpack), and those that went unused and unwritten (a graph dropped); the write of one that
was evicted after all (from the buffer, or by the rest of the cache) is counted in `activations_bytes_written`
when the record goes (`_removed`).

# [Note: the oldest in memory]
A pack that would pass ``activations.buffer`` drops the oldest records in memory, and a deep model sends
hundreds of records a forward, so neither the bytes held nor the oldest record is found by walking all the
records: made at every pack, the walks for the bytes held alone took 0.24-0.31 s of a 1.9-2.8 s step on a
48-layer GPT-2 with 676 records a step (docs/benchmarks.md). The bytes held are the activations arena's
count in the swapper's ledger, kept as partitions take and give back host memory (`Ledger.host_in`). The
records in memory are kept in pack order (`_in_memory`): a record the rest of the cache dropped, or one
removed, leaves the list when `_make_room` comes to it; one that comes back into memory (backward's reads)
is out of that order, so the list is rebuilt from all the records, oldest first, at the next `_make_room`
that has to drop anything.

Views of one storage saved together (GPT-2's query, key and value are views of one projection output)
share one record: a pack whose storage address matches a record whose source is still alive, at the same
version, is the same storage with the same bytes.

Unpack brings the record's partition back (reading it if it was dropped) and rebuilds the tensor: on the
CPU over the host buffer itself, which stays held until autograd frees the last tensor built over it
(the hold rides on the numpy array under the tensor); on a device with memory of its own over a device
copy that autograd then owns, as it would own the activation without offload. Each unpack reads ahead:
records saved before this one (backward goes newest first) are prefetched, up to half of
``activations.buffer``. A record's partition is removed (memory and extent given back) once autograd has
let go of every handle and every tensor built over it.

Objects autograd frees may be freed on another thread; their finalizers only append to a list, which the
compute thread drains at the next pack, unpack or `settle()`.

With ``activations.keep`` the newest of each forward's saved tensors stay in memory, about that many
bytes: pack sends tensors to NVMe until it has sent the previous forward's total less `keep` (all of
them in the first forward), and keeps the rest, which backward then finds without a read. Kept that
way they are counted as ``activations_in_memory_bytes``.

When a record cannot be had (a single tensor larger than ``activations.buffer``, a host cache full of
memory in use, a full disk) the tensor is kept in memory as autograd would keep it, and counted as
``activations_kept_bytes``; nothing fails for want of room.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiermem.errors import BudgetError, StoreError
from tiermem.io.buffers import align_up
from tiermem.sizes import format_size
from tiermem.swap import Tier

if TYPE_CHECKING:
    from tiermem.swap import Partition, TensorSwapper

log = logging.getLogger(__name__)

ARENA = "activations"
"""The host pool's arena the records' partitions ask for (see [Note: host budget] in swap/host_cache.py)."""


class _Hold:
    """One unpacked tensor's hold on its record's host buffer; queued for release when the tensor goes."""

    __slots__ = ("returned", "record")

    def __init__(self, returned: list[_Record], record: _Record) -> None:
        self.returned = returned
        self.record = record

    def __del__(self) -> None:
        self.returned.append(self.record)  # a list append: safe from any thread, takes no lock


class _OwnedArray(np.ndarray):
    """A numpy view of a host buffer that keeps its `_Hold` alive (torch.from_numpy keeps the array)."""

    hold: _Hold


class _Record:
    """One saved storage, kept in a partition of the swapper."""

    __slots__ = ("seq", "nbytes", "part", "handles", "holds", "unpacked", "source", "version", "copying",
                 "deferred", "spared")

    def __init__(self, seq: int, nbytes: int) -> None:
        self.seq = seq
        self.nbytes = nbytes
        self.part: Partition | None = None  # None once removed (or never made)
        self.handles = 0  # live _SavedActivation objects that name this record (less those queued as gone)
        self.holds = 0  # unpacked tensors over its host buffer still alive (less those queued as returned)
        self.unpacked = 0  # unpacks of this record
        self.source: weakref.ref[torch.Tensor] | None = None  # a tensor on the original storage, while alive
        self.version = -1
        self.copying: object | None = None  # the event of its device-to-host copy, until its write starts
        self.deferred = False  # not written when packed: see [Note: activation writes deferred]
        self.spared = False  # deferred, and counted in unwritten_bytes: backward found it in memory unwritten


class _SavedActivation:
    """What autograd holds instead of an offloaded activation."""

    __slots__ = ("store", "record", "dtype", "size", "stride", "offset")

    def __init__(self, store: ActivationStore, record: _Record, t: torch.Tensor) -> None:
        self.store = store
        self.record = record
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        record.handles += 1

    def __del__(self) -> None:
        self.store._gone.append(self.record)  # a list append: safe from any thread, takes no lock


class ActivationStore:
    """Moves saved activations to the swap store and back through the swapper; one per `tiered_offload`."""

    def __init__(self, swapper: TensorSwapper, buffer_bytes: int, min_bytes: int, keep_bytes: int = 0) -> None:
        self.swapper = swapper
        self.quota = buffer_bytes  # activations.buffer: the most host memory activations hold at once
        self.min_bytes = min_bytes
        self.keep_bytes = keep_bytes  # activations.keep: the newest bytes of a forward's that stay in memory
        self._pass_total = 0  # bytes this forward packed (sent, kept or shared), to size the next one's split
        self._pass_sent = 0  # bytes this forward sent toward NVMe
        self._last_total: int | None = None  # _pass_total of the last forward that saved anything
        self.memory_bytes = 0  # saved tensors kept in memory by activations.keep
        self._kept: set[int] = set()  # storage addresses this forward kept in memory by activations.keep
        self.read_ahead_bytes = buffer_bytes // 2
        self._returned: list[_Record] = []  # holds whose tensors autograd freed, to release
        self._gone: list[_Record] = []  # handles autograd freed, to count down
        self._seq = 0
        self._records: deque[_Record] = deque()  # records with a partition, oldest first
        # records in host memory, oldest first, for _make_room; some may have left it since (see
        # [Note: the oldest in memory]); _resort: rebuild it from _records first
        self._in_memory: deque[_Record] = deque()
        self._resort = False
        self._pending: list[_Record] = []  # this pass's records, in pack order (for read-ahead)
        self._ahead = 1 << 62  # the lowest index into _pending that backward has unpacked; reads go below it
        self._cum = [0]  # _cum[i]: bytes of the partitions of _pending[:i] (4 KiB-aligned sizes)
        self._frontier = 1 << 62  # the lowest index into _pending that read-ahead has come to (see _read_ahead)
        self._by_ptr: dict[int, _Record] = {}
        self._copying: list[_Record] = []  # device-to-host copies whose write has not started
        self.bytes_written = 0
        self.bytes_read = 0
        self.unwritten_bytes = 0  # deferred records found unwritten by backward, or gone unused and unwritten
        self.stall_seconds = 0.0  # backward waiting for an activation's bytes
        self.kept_bytes = 0  # saved tensors kept in memory for want of room
        self.saved_bytes = 0  # saved tensors sent to NVMe
        self.peak_host = 0  # most host bytes the activations held at once
        self._warned = False
        self.closed = False

    # -- forward ----------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        """A new top-level forward: records of earlier passes that are still alive stay valid, but
        read-ahead and sharing look only at this pass's."""
        self._drain()
        if self._pass_total:
            self._last_total = self._pass_total
        self._pass_total = self._pass_sent = 0
        self._kept.clear()
        self._pending = [r for r in self._pending if r.part is not None]
        self._cum = [0]
        for r in self._pending:
            self._cum.append(self._cum[-1] + align_up(r.nbytes))
        self._ahead = self._frontier = 1 << 62
        self._by_ptr.clear()
        self._in_memory = deque(r for r in self._in_memory if r.part is not None)

    def pack(self, t: torch.Tensor) -> Any:
        """Send `t`'s storage toward NVMe and return what autograd keeps instead (or `t` itself)."""
        if (t.device.type not in ("cpu", self.swapper.device.type) or t.layout is not torch.strided
                or t.is_quantized or t.requires_grad and t.is_leaf):
            return t
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes or nbytes > 4 * max(t.nbytes, 1):  # small, or a sliver of a big storage
            return t
        self._drain()
        ptr = storage.data_ptr()
        rec = self._by_ptr.get(ptr)
        if rec is not None and rec.part is not None and rec.nbytes == nbytes and rec.version == t._version:
            alive = rec.source() if rec.source is not None else None
            if alive is not None and alive.untyped_storage().data_ptr() == ptr:
                return _SavedActivation(self, rec, t)
        if ptr in self._kept:  # a storage this forward kept in memory, saved again: counted once
            return t
        self._pass_total += nbytes
        last = self._last_total  # None in the first forward, which sends everything: its total is not known yet
        if self.keep_bytes and last is not None and self._pass_sent >= last - self.keep_bytes:
            self._kept.add(ptr)
            self.memory_bytes += nbytes
            return t
        if align_up(nbytes) > self.quota:
            self._keep(nbytes, "it is larger than activations.buffer")
            return t
        if not self._make_room(align_up(nbytes)):
            self._keep(nbytes, "activations.buffer is full of tensors that backward is using")
            return t
        rec = _Record(self._seq, nbytes)
        self._seq += 1
        # among the newest sent, that the buffer will still hold when backward starts: not written
        rec.deferred = (last is not None and self._pass_sent + nbytes > last - self.keep_bytes - self.quota
                        and self._deferred_bytes() + align_up(nbytes) <= self.quota)
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (nbytes,), (1,))
        mover = self.swapper.mover

        def fill(views: dict[str, torch.Tensor]) -> None:
            if mover.has_own_memory:  # from device memory, on the copy stream; the write waits for it
                rec.copying = mover.to_host(src, views["data"])
            else:
                views["data"].copy_(src)

        try:
            rec.part = self.swapper.add(f"activation#{rec.seq}", [("data", _meta(nbytes))], home="nvme", fill=fill,
                                        arena=ARENA)
        except (BudgetError, StoreError, OSError) as exc:  # a full host cache or disk: keep it in memory
            self._keep(nbytes, str(exc))
            return t
        if rec.copying is not None:
            self.swapper.acquire(rec.part, Tier.HOST)  # nothing evicts it before the copy is done
            self._copying.append(rec)
        elif not rec.deferred:
            self._write(rec)
        rec.source = weakref.ref(t._base if t._base is not None else t)
        rec.version = t._version
        self._by_ptr[ptr] = rec
        self._records.append(rec)
        self._in_memory.append(rec)
        self._pending.append(rec)
        self._cum.append(self._cum[-1] + align_up(nbytes))
        self.saved_bytes += nbytes
        self._pass_sent += nbytes
        self.peak_host = max(self.peak_host, self.host_bytes())
        return _SavedActivation(self, rec, t)

    def _write(self, rec: _Record) -> None:
        assert rec.part is not None
        self.swapper.write_back(rec.part)
        self.bytes_written += rec.part.size

    def _deferred_bytes(self) -> int:
        """Host bytes of deferred records not yet written (see [Note: activation writes deferred])."""
        return sum(r.part.size for r in self._records if r.deferred and r.part is not None
                   and self.swapper.owes_write(r.part))

    def _removed(self, rec: _Record, part: Partition) -> None:
        """Count a deferred record's write, if an eviction wrote it after all, or its bytes never written."""
        if not rec.deferred:
            return
        if not self.swapper.owes_write(part):  # written after all (if backward found it unwritten first, both count)
            self.bytes_written += part.size
        elif not rec.spared:
            self.unwritten_bytes += part.size

    def _keep(self, nbytes: int, why: str) -> None:
        self.kept_bytes += nbytes
        if not self._warned:
            self._warned = True
            log.warning("keeping a saved activation of %s in memory: %s", format_size(nbytes), why)

    def host_bytes(self) -> int:
        """Host bytes the activations hold in the cache now (their arena's count in the swapper's ledger)."""
        return self.swapper.host_bytes_in(ARENA)

    def _make_room(self, size: int) -> bool:
        """Drop the oldest activations from host memory (after their writes) until `size` more fits the
        quota; False when the rest are held by tensors backward is using. See [Note: the oldest in memory]."""
        held = self.host_bytes()
        if held + size <= self.quota:
            return True
        if self._resort:
            self._in_memory = deque(r for r in self._records if r.part is not None and self.swapper.holds_host(r.part))
            self._resort = False
        stay: list[_Record] = []  # in memory and not to be dropped now, oldest first
        while self._in_memory and held + size > self.quota:
            rec = self._in_memory.popleft()
            part = rec.part
            if part is None or not self.swapper.holds_host(part):
                continue  # removed, or dropped by the rest of the cache: off the list
            if rec.holds or rec.copying is not None:
                stay.append(rec)
                continue
            try:
                # a write in flight, or a deferred record's write-back that its eviction starts: the bytes
                # must be on disk before the memory goes
                self.swapper.evict(part).wait()
            except OSError as exc:
                log.warning("writing a saved activation to swap failed (%s); keeping it in memory", str(exc))
                stay.append(rec)
                continue
            self.swapper.evict(part)  # now clean: dropped at once
            if self.swapper.holds_host(part):
                stay.append(rec)
            held = self.host_bytes()
        self._in_memory.extendleft(reversed(stay))
        return held + size <= self.quota

    # -- backward ---------------------------------------------------------------------------------
    def unpack(self, saved: _SavedActivation) -> torch.Tensor:
        self._drain()
        rec = saved.record
        part = rec.part
        if part is None:
            raise RuntimeError(f"a saved activation of {format_size(rec.nbytes)} was lost: its swap partition "
                               "is gone (was the graph run after its tiered_offload context ended?)")
        self._start_writes(wait_for=rec)
        t0 = time.perf_counter()
        if not self.swapper.holds_host(part):
            self.bytes_read += part.size
            self._resort = True  # back in memory, out of the pack order of _in_memory
        elif rec.deferred and not rec.spared and self.swapper.owes_write(part):
            rec.spared = True
            self.unwritten_bytes += part.size
        if self.swapper.mover.has_own_memory:  # a device copy that autograd owns from here on, as without offload
            data = self.swapper.mover.tensor_to_device(self.swapper.acquire(part, Tier.HOST)["data"])
            self.swapper.release(part, tier=Tier.HOST)
        else:  # the host buffer itself, held until the last tensor over it goes
            arr = self.swapper.acquire(part, Tier.HOST)["data"].numpy().view(_OwnedArray)
            arr.hold = _Hold(self._returned, rec)
            rec.holds += 1
            data = torch.from_numpy(arr)
        self.stall_seconds += time.perf_counter() - t0
        offset = saved.offset + data.storage_offset() // saved.dtype.itemsize
        out = torch.empty(0, dtype=saved.dtype, device=data.device).set_(
            data.untyped_storage(), offset, saved.size, saved.stride)
        rec.unpacked += 1
        self._read_ahead(rec)
        return out

    def _read_ahead(self, rec: _Record) -> None:
        """Prefetch the records saved before the lowest one backward has unpacked, up to read_ahead_bytes of
        them. The records between that one and the lowest already read ahead were seen by an earlier call, so
        each record is looked at once a pass: their bytes come from `_cum` (every record below the lowest
        unpacked is one backward has not used yet; one freed unused still counts, and only shortens the
        read-ahead). A prefetch that finds no room ends the call, and the next one starts from it again."""
        pending = self._pending
        k = self._index_of(rec)
        if k is not None:
            self._ahead = min(self._ahead, k)
        top = min(self._ahead, len(pending))
        k = min(self._frontier, top) - 1
        ahead = self._cum[top] - self._cum[k + 1]
        while k >= 0 and ahead < self.read_ahead_bytes:
            r = pending[k]
            if r.part is not None and r.unpacked == 0 and not self.swapper.holds_host(r.part):
                if self.swapper.prefetch(r.part, Tier.HOST) is None:
                    return  # no host memory free now
                self.bytes_read += r.part.size
                self._resort = True
            ahead += align_up(r.nbytes)
            self._frontier = k
            k -= 1

    def _index_of(self, rec: _Record) -> int | None:
        pending = self._pending
        lo, hi = 0, len(pending)
        while lo < hi:  # pending is sorted by seq
            mid = (lo + hi) // 2
            if pending[mid].seq < rec.seq:
                lo = mid + 1
            else:
                hi = mid
        return lo if lo < len(pending) and pending[lo] is rec else None

    # -- lifetimes (compute thread) ---------------------------------------------------------------
    def _start_writes(self, *, wait_for: _Record | None = None, wait_all: bool = False) -> None:
        """Start the writes of records whose device-to-host copy is done (waiting for `wait_for`'s, or all)."""
        mover = self.swapper.mover
        still = []
        for rec in self._copying:
            if wait_all or rec is wait_for:
                mover.synchronize(rec.copying)
            if mover.done(rec.copying):
                rec.copying = None
                assert rec.part is not None
                self.swapper.release(rec.part, tier=Tier.HOST)
                if not rec.deferred:
                    self._write(rec)
            else:
                still.append(rec)
        self._copying = still

    def _drain(self) -> None:
        """Apply what autograd let go of: release holds, count down handles, remove finished records."""
        self._start_writes()
        touched = []
        while self._returned:
            rec = self._returned.pop()
            rec.holds -= 1
            if rec.part is not None:
                self.swapper.release(rec.part, tier=Tier.HOST)
            touched.append(rec)
        while self._gone:
            rec = self._gone.pop()
            rec.handles -= 1
            touched.append(rec)
        for rec in touched:
            if rec.handles <= 0 and rec.holds <= 0 and rec.part is not None and rec.copying is None:
                self._remove(rec)

    def _remove(self, rec: _Record) -> None:
        part, rec.part = rec.part, None
        if part is not None and not self.closed:
            self.swapper.remove(part)  # waits for its write in flight, then gives back memory and extent
            self._removed(rec, part)
        try:
            self._records.remove(rec)
        except ValueError:
            pass

    def settle(self) -> None:
        """Wait for transfers in flight and give back what autograd has let go of (memory and extents)."""
        self._start_writes(wait_all=True)
        self._drain()
        for rec in list(self._records):
            if rec.part is not None:
                self.swapper.wait_idle(rec.part)

    def close(self) -> None:
        """Before the swapper closes: finish copies, and forget every record (autograd may still hold some
        handles; using them later raises a clear error)."""
        self.settle()
        self.closed = True
        for rec in list(self._records):
            part, rec.part = rec.part, None
            if part is not None and not part.users:
                self.swapper.remove(part)
                self._removed(rec, part)
        self._records.clear()
        self._in_memory.clear()
        self._pending = []
        self._cum = [0]
        self._by_ptr.clear()

    def stats(self) -> dict[str, Any]:
        return {"activations_saved_bytes": self.saved_bytes, "activations_kept_bytes": self.kept_bytes,
                "activations_in_memory_bytes": self.memory_bytes,
                "activations_stall_seconds": self.stall_seconds, "activations_peak_host_bytes": self.peak_host,
                "activations_bytes_written": self.bytes_written, "activations_bytes_read": self.bytes_read,
                "activations_unwritten_bytes": self.unwritten_bytes}

    def reset_stats(self) -> None:
        self.saved_bytes = self.kept_bytes = self.memory_bytes = self.bytes_written = self.bytes_read = 0
        self.unwritten_bytes = 0
        self.stall_seconds = 0.0
        self.peak_host = self.host_bytes()


def _meta(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")
