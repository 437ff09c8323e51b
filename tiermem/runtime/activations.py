"""Saved activations on NVMe: autograd's saved tensors leave memory in forward and come back for backward.

# [Note: activation offload]
With ``activations.tier: nvme`` the runtime's saved-tensor pack hook hands every saved tensor that is not
a managed parameter (see [Note: backward] in runtime.py) and has at least ``activations.min_bytes`` of
storage to `ActivationStore.pack`. Pack copies the tensor's whole storage into a slot of the store's own
host buffer (``activations.buffer`` bytes, carved out of memory.host_budget), starts an O_DIRECT write of
the slot to an extent of the swap store, and returns a `_SavedActivation` holding the dtype, size, stride
and storage offset. Autograd drops its reference to the original tensor, so forward's activations are
freed as forward goes instead of piling up until backward.

Views of one storage saved together (GPT-2's query, key and value are views of one projection output)
share one record: a pack whose storage address matches a record whose source is still alive, at the same
version, is the same storage with the same bytes.

Slots are given up only when their bytes are safely on disk. When a pack finds the buffer full it first
drops the in-memory copies of the oldest written records, then waits for the oldest write. So when
forward ends the newest activations are still in memory, and they are the ones backward wants first.

Unpack rebuilds the tensor over the slot holding the record's bytes, reading it first if it is not in
memory (into a slot: if none is free it waits for writes in flight, which pin their slots until done).
Each unpack also reads ahead: records saved before this one (backward goes newest first) are read into
free slots, up to half the buffer. A record's slot goes back to the buffer when autograd frees
the last tensor built over it (the slot's owner rides on the numpy array under the tensor) and the record
no longer holds it; its extent goes back to the swap store when autograd frees the last handle (the
graph was run or dropped) and no write is in flight.

When a slot cannot be had (a single tensor larger than the buffer, or every slot held by tensors that
autograd is using) the tensor is kept in memory as autograd would keep it, and counted as
``activations_kept_bytes``; nothing fails for want of buffer. A failed write keeps its bytes in memory.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from typing import Any

import numpy as np
import torch

from tiermem.io.buffers import HostBufferPool, PoolBuffer, align_up
from tiermem.io.future import IOFuture
from tiermem.sizes import format_size
from tiermem.store import SwapStore
from tiermem.store.store import Extent

log = logging.getLogger(__name__)


class _Slot:
    """Owns one piece of the activation buffer; when the last array (and tensor) over it goes, the piece
    is queued for return (a list append: safe from any thread, and never takes a lock)."""

    __slots__ = ("buf", "returned")

    def __init__(self, buf: PoolBuffer, returned: list[PoolBuffer]) -> None:
        self.buf = buf
        self.returned = returned

    def __del__(self) -> None:
        self.returned.append(self.buf)


class _OwnedArray(np.ndarray):
    """A numpy view of a slot that keeps the slot's owner alive (torch.from_numpy keeps the array)."""

    slot: _Slot


class _Record:
    """One saved storage: its bytes in a slot, on disk, or both."""

    __slots__ = ("seq", "nbytes", "data", "extent", "writing", "written", "error", "handles", "unpacked",
                 "reading", "source", "version")

    def __init__(self, seq: int, nbytes: int) -> None:
        self.seq = seq
        self.nbytes = nbytes
        self.data: torch.Tensor | None = None  # uint8 tensor over the slot, while this record holds it
        self.extent: Extent | None = None
        self.writing: IOFuture | None = None
        self.written = False
        self.error: BaseException | None = None
        self.handles = 0  # live _SavedActivation objects that name this record
        self.unpacked = 0  # unpacks since the bytes were last brought into memory
        self.reading: IOFuture | None = None
        self.source: weakref.ref[torch.Tensor] | None = None  # a tensor on the original storage, while alive
        self.version = -1


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
        self.store._handle_gone(self.record)


class ActivationStore:
    """Moves saved activations to the swap store and back; one per `tiered_offload` context."""

    def __init__(self, store: SwapStore, buffer_bytes: int, min_bytes: int) -> None:
        self.store = store
        self.pool = HostBufferPool(buffer_bytes)
        self.min_bytes = min_bytes
        self.read_ahead_bytes = self.pool.nbytes // 2
        self._returned: list[PoolBuffer] = []  # slots whose last user went, to give back to the pool
        self._orphans: list[_Record] = []  # records autograd let go of while their write was in flight
        self._seq = 0
        self._cached: deque[_Record] = deque()  # records holding a slot, oldest first
        self._pending: list[_Record] = []  # this pass's records, in pack order (for read-ahead)
        self._ahead = 1 << 62  # the lowest index into _pending that backward has unpacked; reads go below it
        self._by_ptr: dict[int, _Record] = {}
        self.bytes_written = 0
        self.bytes_read = 0
        self.stall_seconds = 0.0  # backward waiting for an activation's bytes
        self.kept_bytes = 0  # saved tensors kept in memory for want of a slot
        self.saved_bytes = 0  # saved tensors sent to NVMe
        self._warned = False
        self.closed = False

    # -- forward ----------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        """A new top-level forward: records of earlier passes that are still alive stay valid, but
        read-ahead and sharing look only at this pass's."""
        self._pending = [r for r in self._pending if r.handles > 0]
        self._ahead = 1 << 62
        self._by_ptr.clear()

    def pack(self, t: torch.Tensor) -> Any:
        """Send `t`'s storage toward NVMe and return what autograd keeps instead (or `t` itself)."""
        if t.device.type != "cpu" or t.layout is not torch.strided or t.is_quantized or t.requires_grad and t.is_leaf:
            return t
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes or nbytes > 4 * max(t.nbytes, 1):  # small, or a sliver of a big storage
            return t
        ptr = storage.data_ptr()
        rec = self._by_ptr.get(ptr)
        if rec is not None and rec.handles > 0 and rec.nbytes == nbytes and rec.version == t._version:
            alive = rec.source() if rec.source is not None else None
            if alive is not None and alive.untyped_storage().data_ptr() == ptr:
                return _SavedActivation(self, rec, t)
        buf = self._slot_for(nbytes, waiting=True)
        if buf is None:
            self._keep(nbytes, "it is larger than activations.buffer" if align_up(nbytes) > self.pool.nbytes
                       else "activations.buffer is full of tensors that backward is using")
            return t
        rec = _Record(self._seq, nbytes)
        self._seq += 1
        try:
            rec.extent = self.store.allocate(nbytes)
        except Exception as exc:  # a full disk: keep the bytes in memory rather than fail the forward
            self._returned.append(buf)
            self._keep(nbytes, str(exc))
            return t
        data = self._over(buf)
        data[:nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,)))
        rec.data = data
        rec.source = weakref.ref(t._base if t._base is not None else t)
        rec.version = t._version
        self._by_ptr[ptr] = rec
        self._cached.append(rec)
        self._pending.append(rec)
        self.saved_bytes += nbytes
        rec.writing = self.store.write(rec.extent, data, nbytes=rec.extent.size)
        self.bytes_written += rec.extent.size
        return _SavedActivation(self, rec, t)

    def _keep(self, nbytes: int, why: str) -> None:
        self.kept_bytes += nbytes
        if not self._warned:
            self._warned = True
            log.warning("keeping a saved activation of %s in memory: %s", format_size(nbytes), why)

    def _settle(self, rec: _Record) -> bool:
        """Note a finished write; True when the record's bytes are safely on disk."""
        f = rec.writing
        if f is not None and f.done():
            rec.writing = None
            rec.error = f.exception()
            rec.written = rec.error is None
            if rec.error is not None:
                log.warning("writing a saved activation to swap failed (%s); keeping it in memory", rec.error)
        return rec.written

    # -- backward ---------------------------------------------------------------------------------
    def unpack(self, saved: _SavedActivation) -> torch.Tensor:
        rec = saved.record
        data = rec.data
        if data is None:
            t0 = time.perf_counter()
            if rec.reading is None:
                self._start_read(rec, waiting=True)
            reading = rec.reading
            if reading is not None:
                reading.wait()
                rec.reading = None
            data = rec.data
            self.stall_seconds += time.perf_counter() - t0
            assert data is not None
        elif rec.reading is not None:
            t0 = time.perf_counter()
            rec.reading.wait()
            rec.reading = None
            self.stall_seconds += time.perf_counter() - t0
        offset = saved.offset + data.storage_offset() // saved.dtype.itemsize  # data may start inside its storage
        out = torch.empty(0, dtype=saved.dtype).set_(data.untyped_storage(), offset, saved.size, saved.stride)
        rec.unpacked += 1
        if rec.unpacked >= rec.handles and self._settle(rec):
            self._uncache(rec)  # autograd holds the tensor now; the slot comes back when it lets go
        self._read_ahead(rec)
        return out

    def _read_ahead(self, rec: _Record) -> None:
        pending = self._pending
        k = self._index_of(rec)
        if k is not None:
            self._ahead = min(self._ahead, k)
        ahead = 0
        k = min(self._ahead, len(pending)) - 1
        while k >= 0 and ahead < self.read_ahead_bytes:
            r = pending[k]
            if r.handles > 0 and r.unpacked == 0:
                if r.data is None and r.reading is None:
                    if not self._start_read(r, waiting=False):
                        return
                ahead += r.nbytes
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

    def _start_read(self, rec: _Record, *, waiting: bool) -> bool:
        """Bring a written record back into a slot (or, waiting, into memory outside the buffer)."""
        if rec.error is not None or rec.extent is None:
            raise RuntimeError(f"a saved activation of {format_size(rec.nbytes)} was lost: {rec.error}")
        # backward needs these bytes now: waiting for a write in flight to free a slot keeps the buffer's
        # bound; a read-ahead takes only what is free at once
        buf = self._slot_for(rec.nbytes, waiting=waiting, below=None if waiting else rec.seq)
        if buf is None:
            if not waiting:
                return False
            data = _aligned_empty(rec.extent.size)  # every slot is in use by backward: read outside
            self.kept_bytes += rec.nbytes
        else:
            data = self._over(buf)
            self._cached.append(rec)
        rec.data = data
        rec.unpacked = 0
        rec.reading = self.store.read(rec.extent, data, nbytes=rec.extent.size)
        self.bytes_read += rec.extent.size
        return True

    # -- slots and lifetimes ----------------------------------------------------------------------
    def _over(self, buf: PoolBuffer) -> torch.Tensor:
        arr = buf.numpy().view(_OwnedArray)
        arr.slot = _Slot(buf, self._returned)
        return torch.from_numpy(arr)

    def _drain(self) -> None:
        while self._returned:
            self.pool.free(self._returned.pop())
        if self._orphans:
            waiting = []
            for rec in self._orphans:
                if rec.writing is not None and not rec.writing.done():
                    waiting.append(rec)
                else:
                    rec.writing = None
                    self._free_extent(rec)
            self._orphans = waiting

    def _slot_for(self, nbytes: int, *, waiting: bool, below: int | None = None) -> PoolBuffer | None:
        """A slot of `nbytes`, dropping the in-memory copies of written records to make room, oldest
        first: in forward they are the ones backward needs last. `below`: drop only records older than
        that (a read-ahead must not push out what backward needs sooner). When `waiting`, also wait for
        writes in flight. None when nothing more can be freed."""
        size = align_up(nbytes)
        if size > self.pool.nbytes:
            return None
        while True:
            self._drain()
            if self.pool.nbytes - self.pool.used >= size:
                try:
                    return self.pool.alloc(size)
                except Exception:  # fragmented: free more below
                    pass
            victim = min((r for r in self._cached if r.reading is None and (below is None or r.seq < below)
                          and self._settle(r)), key=lambda r: r.seq, default=None)
            if victim is not None:
                self._uncache(victim)
                continue
            # a write in flight pins its slot, whether its record is cached or autograd let go of it
            writing = next((r.writing for r in (*self._cached, *self._orphans) if r.writing is not None), None)
            if waiting and writing is not None:
                try:
                    writing.wait()
                except OSError:
                    pass  # _settle notes the error; that record keeps its bytes in memory
                continue
            return None

    def _uncache(self, rec: _Record) -> None:
        rec.data = None
        try:
            self._cached.remove(rec)
        except ValueError:
            pass

    def _handle_gone(self, rec: _Record) -> None:
        """Autograd dropped a handle; the last one frees the record's extent (after its write)."""
        rec.handles -= 1
        if rec.handles > 0 or self.closed:
            return
        if rec.data is not None:
            self._uncache(rec)
        if rec.writing is not None and not rec.writing.done():
            self._orphans.append(rec)
        else:
            rec.writing = None
            self._free_extent(rec)

    def _free_extent(self, rec: _Record) -> None:
        ext, rec.extent = rec.extent, None
        if ext is not None and not self.store.closed:
            self.store.free(ext)

    def wait_idle(self) -> None:
        """Wait for every write and read in flight (before the swap store closes)."""
        for rec in list(self._pending) + list(self._cached) + self._orphans:
            for f in (rec.writing, rec.reading):
                if f is not None:
                    f.wait()

    def settle(self) -> None:
        """Wait for transfers in flight and give back what autograd has let go of (slots and extents)."""
        self.wait_idle()
        self._drain()

    def close(self) -> None:
        self.wait_idle()
        self.closed = True
        self._cached.clear()
        self._pending = []
        self._by_ptr.clear()
        self._drain()
        self.pool.close()  # tensors autograd still holds keep the memory alive until they go

    def stats(self) -> dict[str, Any]:
        return {"activations_saved_bytes": self.saved_bytes, "activations_kept_bytes": self.kept_bytes,
                "activations_stall_seconds": self.stall_seconds, "activations_peak_host_bytes": self.pool.peak,
                "activations_bytes_written": self.bytes_written, "activations_bytes_read": self.bytes_read}

    def reset_stats(self) -> None:
        self.saved_bytes = self.kept_bytes = self.bytes_written = self.bytes_read = 0
        self.stall_seconds = 0.0
        self.pool.peak = self.pool.used


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """A 4 KiB-aligned uint8 CPU tensor of `nbytes` from torch's allocator (for O_DIRECT)."""
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    return raw[skip : skip + nbytes]
