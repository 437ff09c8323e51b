"""The io_uring backend: one ring driven by one completion thread, fixed buffers, batched submits.

# [Note: the ring loop]
A ring is not safe to submit to from several threads, so one thread owns it. Callers append chunks to a
pending deque under a lock and return at once with an IOFuture. The loop: move pending chunks into the
ring up to queue depth and submit them with one system call, then block in the C core (GIL released) for
one completion and drain every completion that is ready. A short read or write is resubmitted for its
remainder and -EAGAIN/-EINTR are resubmitted as they were; other errors fail the chunk's future.
With many requests in flight the loop waits for an eighth of them before refilling, so one submit
carries several requests while the queue stays at least 7/8 full.
While blocked, the thread must notice new work: an 8-byte read on an eventfd is kept in the ring, and a
caller that queues work while the loop sleeps writes that eventfd, which completes the read and wakes it,
unless at least half the queue depth is in flight: then the next completions wake the loop soon enough.
"""

from __future__ import annotations

import bisect
import collections
import errno
import logging
import os
import threading

from tiermem.io import _native
from tiermem.io.engine import DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH, OP_READ, RETRYABLE, Chunk, IOEngine
from tiermem.sizes import format_size

log = logging.getLogger(__name__)

_WAKE = 0  # user_data of the eventfd read; chunk ids start at 1
MAX_FIXED_BUFFER = 1 << 30  # the kernel's limit for one registered buffer


class UringEngine(IOEngine):
    """io_uring with batched submission, queue-depth bound, fixed buffers and optional SQPOLL."""

    name = "io_uring"

    def __init__(self, *, block_size: int = DEFAULT_BLOCK_SIZE, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 sqpoll: bool = False) -> None:
        super().__init__(block_size=block_size, queue_depth=queue_depth)
        self.sqpoll = sqpoll
        ffi = _native.ffi
        # queue_depth chunks plus the wake read must fit; the CQ is twice the SQ by default
        self._ring = _native.Ring(queue_depth + 1, sqpoll=sqpoll)
        self._lock = threading.Lock()
        self._pending: collections.deque[Chunk] = collections.deque()  # chunks not yet in the ring
        self._inflight: dict[int, Chunk] = {}  # user_data -> chunk submitted and not completed
        self._next_id = 1
        self._sleeping = False  # the loop is (about to be) blocked in the ring; new work must wake it
        self._stopping = False
        self._control: collections.deque[tuple[str, object, threading.Event, list[object]]] = (
            collections.deque())  # ring operations that must run on the loop's thread
        self._fixed: list[tuple[int, int, int]] = []  # sorted (start, end, index) of registered buffers
        self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC)
        self._wake_buf = ffi.new("uint64_t *")  # where the eventfd read lands
        self._wake_armed = False
        self._reqs = ffi.new("struct tm_req[]", queue_depth + 1)  # submit staging, reused
        self._cqes = ffi.new("struct tm_cqe[]", 2 * (queue_depth + 1))  # reap staging, reused
        self.submits = 0  # system calls that submitted work, for the benchmark's batching figure
        self._thread = threading.Thread(target=self._loop, name="tiermem-uring", daemon=True)
        self._thread.start()

    # -- caller side ---------------------------------------------------------------------------
    def _submit(self, chunks: list[Chunk]) -> None:
        with self._lock:
            if self._stopping:
                raise OSError(errno.ESHUTDOWN, "the io_uring engine is closed")
            self._pending.extend(chunks)
            # A loop asleep on a well-filled ring wakes for its next completions anyway and takes the new
            # chunks then; waking it now would cost a system call and two context switches per request.
            wake = self._sleeping and len(self._inflight) < max(1, self.queue_depth // 2)
            if wake:
                self._sleeping = False
        if wake:
            os.eventfd_write(self._wake_fd, 1)

    def register_buffers(self, regions: list[tuple[int, int]]) -> bool:
        """Register host regions as fixed buffers (split at 1 GiB); reads/writes inside them skip page pinning."""
        pieces = [(a + off, min(MAX_FIXED_BUFFER, n - off))
                  for a, n in regions for off in range(0, n, MAX_FIXED_BUFFER)]
        result = self._call("register", pieces)
        if isinstance(result, OSError):
            log.warning("io_uring could not register %s of fixed buffers (%s); using plain reads and writes",
                        format_size(sum(n for _, n in pieces)), result.strerror)
            return False
        return True

    def _call(self, what: str, arg: object) -> object:
        if self.closed:
            raise OSError(errno.ESHUTDOWN, "the io_uring engine is closed")
        done = threading.Event()
        box: list[object] = []
        with self._lock:
            self._control.append((what, arg, done, box))
            wake = self._sleeping
            self._sleeping = False
        if wake:
            os.eventfd_write(self._wake_fd, 1)
        while not done.wait(0.5):
            if not self._thread.is_alive():
                raise OSError(errno.ESHUTDOWN, "the io_uring loop has stopped")
        return box[0] if box else None

    def close(self) -> None:
        """Wait for everything queued to finish, then tear the ring down."""
        if self.closed:
            return
        self.closed = True
        with self._lock:
            self._stopping = True
            wake = self._sleeping
            self._sleeping = False
        if wake:
            os.eventfd_write(self._wake_fd, 1)
        self._thread.join()
        self._ring.close()
        os.close(self._wake_fd)

    # -- the loop's side -----------------------------------------------------------------------
    def _run_control(self) -> None:
        while self._control:
            what, arg, done, box = self._control.popleft()
            try:
                if what == "register":
                    regions = sorted(arg)  # type: ignore[call-overload]
                    if self._fixed:
                        self._ring.unregister_buffers()
                        self._fixed = []
                    self._ring.register_buffers(regions)
                    self._fixed = [(a, a + n, i) for i, (a, n) in enumerate(regions)]
            except OSError as exc:
                box.append(exc)
            done.set()

    def _fixed_index(self, address: int, length: int) -> int:
        if len(self._fixed) == 1:  # the usual case: one pool
            start, end, index = self._fixed[0]
            return index if start <= address and address + length <= end else -1
        i = bisect.bisect_right(self._fixed, (address, float("inf"), 0)) - 1
        if i >= 0:
            start, end, index = self._fixed[i]
            if start <= address and address + length <= end:
                return index
        return -1

    def _fill(self) -> int:
        """Stage pending chunks (and the wake read) and submit them in one call; return how many chunks."""
        reqs = self._reqs
        n = 0
        if not self._wake_armed:
            r = reqs[0]
            r.user_data, r.addr, r.offset, r.len = _WAKE, int(_native.ffi.cast("uintptr_t", self._wake_buf)), 0, 8
            r.fd, r.op, r.buf_index = self._wake_fd, _native.OP_READ, -1
            n = 1
        wake_staged = n == 1  # the eventfd wake read goes in with this batch
        with self._lock:
            room = self.queue_depth - len(self._inflight)
            while room > 0 and self._pending:
                chunk = self._pending.popleft()
                cid = self._next_id
                self._next_id += 1
                self._inflight[cid] = chunk
                r = reqs[n]
                r.user_data, r.addr, r.offset, r.len = cid, chunk.address, chunk.offset, chunk.length
                r.fd = chunk.file.fd_for(chunk.address, chunk.offset, chunk.length)
                r.op = _native.OP_READ if chunk.op == OP_READ else _native.OP_WRITE
                r.buf_index = self._fixed_index(chunk.address, chunk.length) if self._fixed else -1
                n += 1
                room -= 1
        if n == 0:
            return 0
        queued = self._ring.submit(reqs, n)  # an OSError here is fatal for the ring: _loop fails everything
        self.submits += 1
        if queued < n:  # the SQ was full (an SQPOLL thread lagging): put back what did not go in
            with self._lock:
                for i in range(n - 1, queued - 1, -1):
                    cid = int(reqs[i].user_data)
                    if cid != _WAKE:
                        self._pending.appendleft(self._inflight.pop(cid))
        if wake_staged and queued > 0:
            self._wake_armed = True
        return queued

    def _complete(self, cid: int, res: int) -> None:
        chunk = self._inflight.pop(cid)
        if res < 0:
            if -res in RETRYABLE:
                self._requeue(chunk)
                return
            chunk.future._chunk_done(chunk.error(-res))
            return
        if res == 0 and chunk.length:
            chunk.future._chunk_done(chunk.past_end() if chunk.op == OP_READ else chunk.error(errno.ENOSPC))
            return
        chunk.advance(res)
        if chunk.length:
            self._requeue(chunk)
        else:
            chunk.future._chunk_done(None)

    def _requeue(self, chunk: Chunk) -> None:
        with self._lock:
            self._pending.appendleft(chunk)

    def _loop(self) -> None:
        cqes = self._cqes
        cap = len(cqes)
        try:
            while True:
                if self._control:
                    self._run_control()
                self._fill()
                with self._lock:
                    if self._stopping and not self._inflight and not self._pending:
                        return
                    if (self._pending and len(self._inflight) < self.queue_depth) or self._control:
                        continue
                    self._sleeping = True
                    # with a deep queue, wait for an eighth of it to drain so that each refill is one
                    # submit of several requests; the queue never falls below 7/8 of its depth
                    wait_nr = max(1, len(self._inflight) // 8)
                got = self._ring.reap(cqes, cap, wait_nr)
                with self._lock:
                    self._sleeping = False
                for i in range(got):
                    cid, res = cqes[i].user_data, cqes[i].res
                    if cid == _WAKE:
                        self._wake_armed = False
                    else:
                        self._complete(cid, res)
        except BaseException as exc:  # never leave a caller waiting forever
            log.exception("the io_uring loop failed")
            with self._lock:
                self._stopping = True
                dead = list(self._inflight.values()) + list(self._pending)
                self._inflight.clear()
                self._pending.clear()
            for chunk in dead:
                chunk.future._chunk_done(OSError(errno.EIO, f"io_uring loop failed: {exc}", chunk.file.path))
