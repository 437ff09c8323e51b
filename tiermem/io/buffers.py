"""Aligned host memory: buffers backed by (transparent huge page) mmaps, pinned for CUDA when asked.

# [Note: host buffers]
All host memory that the kernel reads or writes with O_DIRECT comes from here. Each buffer is one
anonymous mmap, placed at a 2 MiB boundary and advised MADV_HUGEPAGE, because on virtio disks huge-page
backed buffers let the block layer build larger requests (a plain pread loop went from 1.7 to 2.5 GB/s
here). A single buffer is touched once at allocation so that no page fault lands inside a timed
transfer; a pool is faulted in as it is used, so resident memory grows with use up to its size.
A pool is allocated once and carved with a first-fit free list; nothing is allocated per transfer.

# [Note: pinning host buffers]
Page-locking (cudaHostRegister) is what lets H2D/D2H copies run asynchronously, but it faults in and
locks every page at once, so it is the caller's decision, never implied by CUDA being installed: nothing
is pinned unless asked for (`pin=True` at construction, or `pin()` later). A pool whose compute device is
the CPU is never pinned; the swapper pins its pool only for a CUDA device, and only when it registers the
pool with the I/O engine, after the model's own parameters are in their partitions and freed, so the two never add up.
Registration uses cudaHostRegisterPortable, so the memory counts as pinned for every CUDA context and
device, not only the one current on the calling thread. A failed registration also sets CUDA's per-thread
last error, which the next kernel launch check would report as its own failure; it is read back
(cleared) at once. close() unpins.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from tiermem.errors import BudgetError
from tiermem.freelist import FreeList
from tiermem.sizes import IO_ALIGN, format_size

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

try:
    from cffi import FFI

    _ffi: Any = FFI()
except ImportError:  # pragma: no cover - cffi is a dependency; numpy serves without it
    _ffi = None

ALIGN = IO_ALIGN  # tiermem/sizes.py says why
HUGE_PAGE = 2 * 1024 * 1024
# cudaHostRegisterPortable: the memory is pinned for all CUDA contexts, not only the current device's
CUDA_HOST_REGISTER_PORTABLE = 1


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def aligned(*values: int) -> bool:
    """Whether every value (address, offset, length) is a multiple of ALIGN, as O_DIRECT needs."""
    return all(v % ALIGN == 0 for v in values)


def check_io_size(key: str, value: int, error: type[Exception] = ValueError) -> int:
    """Return `value` if it is a positive multiple of ALIGN (a block or stripe size that keeps direct I/O
    aligned), else raise `error` naming `key`."""
    if value <= 0 or not aligned(value):
        raise error(f"{key}: expected a positive multiple of {ALIGN} bytes, got {value}")
    return value


def buffer_address(buf: Any) -> int:
    """Address of the first byte of a buffer-protocol object or a contiguous CPU torch tensor."""
    if hasattr(buf, "data_ptr"):
        return int(buf.data_ptr())
    if _ffi is not None:  # 4x cheaper than numpy's, and this runs once per transfer
        return int(_ffi.cast("uintptr_t", _ffi.from_buffer(buf)))
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def as_bytes_view(buf: Any) -> memoryview:
    """A flat byte memoryview over `buf` (buffer-protocol object or contiguous CPU tensor), no copy."""
    if hasattr(buf, "data_ptr"):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("tiermem I/O needs a contiguous CPU tensor; call .contiguous().cpu() first")
        import torch

        return memoryview(buf.reshape(-1).view(torch.uint8).numpy()).cast("B")
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("tiermem I/O needs a C-contiguous buffer")
    return view.cast("B")


class AlignedBuffer:
    """One mmap-backed, 2 MiB-aligned block of host memory; exposed as memoryview, numpy and torch."""

    def __init__(self, nbytes: int, *, huge_pages: bool = True, pin: bool = False,
                 prefault: bool = True) -> None:
        if nbytes <= 0:
            raise ValueError(f"buffer size must be > 0, got {nbytes}")
        self.nbytes = align_up(nbytes)
        slack = HUGE_PAGE if huge_pages else 0
        self._map = mmap.mmap(-1, self.nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = buffer_address(self._map)
        self._start = (align_up(base, HUGE_PAGE) - base) if huge_pages else 0  # offset of the aligned start
        self.huge_pages = False  # whether the kernel accepted MADV_HUGEPAGE for this range
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, 0, len(self._map))
                self.huge_pages = True
            except OSError as exc:
                log.debug("MADV_HUGEPAGE refused (%s); using normal pages", exc)
        self.view = memoryview(self._map)[self._start : self._start + self.nbytes]
        if prefault:
            np.frombuffer(self.view, dtype=np.uint8).fill(0)  # fault every page in now, not during I/O
        self.address = base + self._start
        self.pinned = False  # page-locked for CUDA (cudaHostRegister) so copies can be asynchronous
        self._pin_lock = threading.Lock()  # pin() and close() from different threads register/unregister once
        self.closed = False  # close() was called; the mapping itself may outlive it while views remain
        if pin:
            try:
                self.pin(required=True)
            except BaseException:
                self.close()
                raise

    def pin(self, *, required: bool = False) -> bool:
        """Page-lock this buffer for CUDA copies, once; return whether it is pinned now.

        A failure (no CUDA, or cudaHostRegister refused) raises RuntimeError when `required`, else is
        logged as a warning and the buffer stays pageable: copies from it are then synchronous. See
        [Note: pinning host buffers].
        """
        with self._pin_lock:
            if self.closed:
                raise ValueError(f"buffer at {self.address:#x} is closed; it cannot be pinned")
            if not self.pinned:
                self.pinned = _cuda_host_register(self.address, self.nbytes, required=required)
            return self.pinned

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.view, dtype=np.uint8)

    def tensor(self) -> torch.Tensor:
        """The whole buffer as a uint8 CPU tensor sharing this memory."""
        import torch

        return torch.frombuffer(self.view, dtype=torch.uint8)

    def close(self) -> None:
        """Release the memory; views handed out must no longer be used."""
        with self._pin_lock:
            if self._map.closed:
                return
            self.closed = True
            if self.pinned:
                _cuda_host_unregister(self.address)
                self.pinned = False
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            log.debug("buffer at %#x still has exported views; freed when they go", self.address)

    def __enter__(self) -> AlignedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PoolBuffer:
    """A slice of a HostBufferPool, from one of its arenas; give it back with `release()`."""

    __slots__ = ("pool", "offset", "nbytes", "arena", "view", "address")

    def __init__(self, pool: HostBufferPool, offset: int, nbytes: int, arena: str = "main") -> None:
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.arena = arena
        self.view = pool.buffer.view[offset : offset + nbytes]
        self.address = pool.buffer.address + offset

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.view, dtype=np.uint8)

    def tensor(self) -> torch.Tensor:
        import torch

        return torch.frombuffer(self.view, dtype=torch.uint8)

    def release(self) -> None:
        self.pool.free(self)


class HostBufferPool:
    """A fixed amount of aligned host memory allocated once and carved into 4 KiB-aligned pieces.

    `alloc` never grows the pool: when it cannot fit a request it raises BudgetError naming the size
    and what is free, so callers evict or wait instead of exceeding the host budget.

    `add_arena(name, nbytes)` sets aside the bottom of the pool for one kind of piece: pieces that come
    and go at another pace (saved activations) then never split the room the others need in one piece.

    Args:
        nbytes: the pool's size (rounded up to 4 KiB).
        huge_pages: place it at a 2 MiB boundary and advise MADV_HUGEPAGE.
        pin: page-lock it for CUDA now; RuntimeError if that fails. Default False: pageable until `pin()`.
        prefault: touch every page now instead of as pieces are first used.

    Example::

        pool = HostBufferPool(1 << 30)
        if device.type == "cuda":
            pool.pin()                    # when the memory is about to be used for copies, not before
        piece = pool.alloc(4 << 20)
        ...
        piece.release()
        pool.close()                      # unpins too
    """

    def __init__(self, nbytes: int, *, huge_pages: bool = True, pin: bool = False,
                 prefault: bool = False) -> None:
        # not prefaulted by default: pages are faulted in as pieces are first used, so resident memory
        # grows with use up to the budget instead of starting there
        self.buffer = AlignedBuffer(nbytes, huge_pages=huge_pages, pin=pin, prefault=prefault)
        self.nbytes = self.buffer.nbytes
        self._lock = threading.Lock()
        self._free = {"main": FreeList(self.nbytes)}  # the pieces not handed out, per arena
        self.arena_bytes = {"main": self.nbytes}
        self.used = 0  # bytes handed out now
        self.peak = 0  # most bytes handed out at once

    def add_arena(self, name: str, nbytes: int) -> None:
        """Set aside `nbytes` (rounded up to 4 KiB) at the bottom of the pool, allocated only by
        `alloc(..., arena=name)`; before anything is allocated."""
        size = align_up(nbytes)
        with self._lock:
            if name in self._free or self.used or size >= self.arena_bytes["main"]:
                raise ValueError(f"cannot add arena {name!r} of {format_size(size)} to this pool")
            start = self.nbytes - self.arena_bytes["main"]  # the arenas before this one sit below it
            self._free[name] = FreeList()
            self._free[name].give(start, size)
            self.arena_bytes[name] = size
            self.arena_bytes["main"] -= size
            self._free["main"] = FreeList()
            self._free["main"].give(start + size, self.arena_bytes["main"])

    @property
    def pinned(self) -> bool:
        """Whether the pool is page-locked for CUDA."""
        return self.buffer.pinned

    def pin(self, *, required: bool = False) -> bool:
        """Page-lock the whole pool for CUDA copies, once; return whether it is pinned now.

        Faults in and locks every page, so call it when the pool is about to serve device copies (see
        [Note: pinning host buffers]). A failure raises RuntimeError when `required`, else is logged as
        a warning and the pool stays pageable (copies from it are synchronous).
        """
        return self.buffer.pin(required=required)

    @property
    def regions(self) -> list[tuple[int, int]]:
        """(address, length) ranges to register with an I/O engine as fixed buffers."""
        return [(self.buffer.address, self.nbytes)]

    def alloc(self, nbytes: int, *, from_top: bool = False, arena: str = "main") -> PoolBuffer:
        """A 4 KiB-aligned piece of at least `nbytes` from `arena`. `from_top` takes it from the high end:
        long-lived pieces go there, so they do not split the room that short-lived ones come and go in."""
        size = align_up(max(nbytes, 1))
        with self._lock:
            free = self._free[arena]
            start = free.take(size, from_top=from_top)
            if start is not None:
                self.used += size
                self.peak = max(self.peak, self.used)
                return PoolBuffer(self, start, size, arena)
            largest, total = free.largest(), sum(h for _, h in free.holes)
        where = "" if arena == "main" else f" arena {arena!r}"
        raise BudgetError(
            f"host buffer pool{where} cannot fit {format_size(size)}: {format_size(total)} free "
            f"(largest piece {format_size(largest)}) of {format_size(self.arena_bytes[arena])}; raise "
            "memory.host_budget, or use smaller units (wrap.classes) so that each partition needs less"
        )

    def alloc_at(self, offset: int, nbytes: int, arena: str = "main") -> PoolBuffer | None:
        """The piece of at least `nbytes` at `offset` of the pool, if that range of `arena` is free; else None."""
        size = align_up(max(nbytes, 1))
        with self._lock:
            if not self._free[arena].take_at(offset, size):
                return None
            self.used += size
            self.peak = max(self.peak, self.used)
            return PoolBuffer(self, offset, size, arena)

    def holes(self, arena: str = "main") -> list[tuple[int, int]]:
        """The free (offset, size) ranges of `arena`, in order."""
        with self._lock:
            return list(self._free[arena].holes)

    def largest_free(self, arena: str = "main") -> int:
        """The largest piece `alloc` could hand out from `arena` now."""
        with self._lock:
            return self._free[arena].largest()

    def free(self, buf: PoolBuffer) -> None:
        with self._lock:
            self._free[buf.arena].give(buf.offset, buf.nbytes)
            self.used -= buf.nbytes

    def close(self) -> None:
        self.buffer.close()

    def __enter__(self) -> HostBufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cuda_host_register(address: int, nbytes: int, *, required: bool) -> bool:
    """cudaHostRegister(portable) the range; True when pinned. Failures raise if `required`, else warn."""
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is None or not torch.cuda.is_available():
        if required:
            raise RuntimeError(f"pinning {format_size(nbytes)} of host memory needs CUDA, which is not available "
                               "here; leave pin off (the default) on a CPU-only machine")
        log.warning("cannot pin %s of host memory: CUDA is not available; host copies will be synchronous",
                    format_size(nbytes))
        return False
    try:
        cudart = torch.cuda.cudart()
    except (AssertionError, RuntimeError) as exc:  # no libcudart bindings, or CUDA unusable after fork()
        if required:
            raise RuntimeError(f"pinning {format_size(nbytes)} of host memory needs CUDA, which cannot be "
                               f"used here ({exc})") from exc
        log.warning("cannot pin %s of host memory (%s); host copies will be synchronous", format_size(nbytes), exc)
        return False
    err = int(cudart.cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if err == 0:
        return True
    _clear_cuda_error(cudart)
    what = f"cudaHostRegister of {format_size(nbytes)} at {address:#x} failed with CUDA error {err}"
    if required:
        raise RuntimeError(f"{what}; raise the locked-memory limit (ulimit -l) or lower memory.host_budget")
    log.warning("%s; host copies will be synchronous", what)
    return False


def _cuda_host_unregister(address: int) -> None:
    import torch

    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostUnregister(address))
    if err != 0:
        _clear_cuda_error(cudart)
        log.warning("cudaHostUnregister at %#x failed with CUDA error %d", address, err)


def _clear_cuda_error(cudart: Any) -> None:
    """Read back (and so reset) CUDA's last error on this thread, so no later kernel launch reports it."""
    get_last_error = getattr(cudart, "cudaGetLastError", None)
    if get_last_error is None:  # torch's cudart bindings have no cudaGetLastError: ask the library itself
        get_last_error = _loaded_cudart_get_last_error()
    if get_last_error is not None:
        get_last_error()


@functools.lru_cache(maxsize=1)
def _loaded_cudart_get_last_error() -> Any:
    """cudaGetLastError of the libcudart this process already loaded (torch's), or None.

    The last error lives in that library instance, so another copy of it would not do. None when cudart
    is linked statically.
    """
    func = _loaded_library_function("libcudart", "cudaGetLastError")
    if func is None:
        log.debug("no shared libcudart loaded; a failed cudaHostRegister leaves CUDA's last error set")
    return func


def _loaded_library_function(prefix: str, name: str) -> Any:
    """Function `name` (returning int) of an already loaded shared library whose file name starts with
    `prefix`, or None. The path comes from /proc/self/maps, and RTLD_NOLOAD refuses to load anything new."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(None, 5) for line in maps]
    except OSError:
        return None
    paths = {f[5].strip() for f in fields if len(f) == 6}
    for path in sorted(p for p in paths if os.path.basename(p).startswith(prefix)):
        try:
            func = getattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL), name)
        except (OSError, AttributeError):
            continue
        func.restype = ctypes.c_int
        func.argtypes = []
        return func
    return None
