"""The io_uring backend: a C transfer pipeline (csrc/tm_uring.c) driven by one completion thread.

# [Note: the ring loop]
A ring is not safe to submit to from several threads, so one thread owns it. A caller hands a whole
request (all its pieces, in one or several files) to the C core in one call (`tm_engine_enqueue`, under
the core's mutex) and returns at once with one IOFuture. The loop thread sits in `tm_engine_run` with the
GIL released. There the core splits pieces into block-size chunks, keeps at most queue-depth chunks in the
ring and submits each batch with one system call, resubmits short and -EAGAIN/-EINTR chunks, and hands
back a request only when the last chunk of its last piece has finished. With many chunks in flight it
waits for an eighth of them before refilling, so one submit carries several chunks while the ring stays at
least 7/8 full. Python sees each request twice (queued, finished), never each piece or chunk: at 1 MiB
blocks the per-chunk work is what fio's CPU figure measures, and doing it in Python cost about twice fio's
CPU per GiB.
While the loop blocks, an 8-byte read of an eventfd sits in the ring; a caller that queues work while the
loop sleeps on a ring under half full writes that eventfd, which completes the read and wakes the loop.
With more in flight, the next completions wake it soon enough, and a wake costs a system call.
Work that must run on the loop's thread (registering buffers) goes through `_call`: the loop is kicked
out of `tm_engine_run`, runs it, and goes back in.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import threading

from tiermem.errors import IOEngineError
from tiermem.interrupts import deferred_interrupts
from tiermem.io import _native
from tiermem.io.buffers import ALIGN
from tiermem.io.engine import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_QUEUE_DEPTH,
    IOEngine,
    Piece,
    past_end_error,
    transfer_error,
)
from tiermem.io.future import IOFuture
from tiermem.sizes import format_size

log = logging.getLogger(__name__)

MAX_FIXED_BUFFER = 1 << 30  # the kernel's limit for one registered buffer


class UringEngine(IOEngine):
    """io_uring with batched submission, queue-depth bound, fixed buffers and optional SQPOLL."""

    name = "io_uring"

    def __init__(self, *, block_size: int = DEFAULT_BLOCK_SIZE, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 sqpoll: bool = False) -> None:
        super().__init__(block_size=block_size, queue_depth=queue_depth)
        if block_size >= 1 << 32:
            raise IOEngineError(
                f"io.block_size: {format_size(block_size)} is over io_uring's limit; use less than 4GiB")
        self.sqpoll = sqpoll
        self._core = _native.NativeEngine(queue_depth, block_size, sqpoll=sqpoll)
        self._ids = itertools.count(1)
        self._live: dict[int, tuple[IOFuture, list[Piece], int]] = {}  # user_data -> request not yet finished
        self._control: collections.deque[tuple[str, object, threading.Event, list[object]]] = (
            collections.deque())  # work that must run on the loop's thread
        # held across the closed check and each call into the core by a caller, so that close() cannot
        # free the core under a caller that is about to queue work
        self._calls = threading.Lock()
        # the ring's thread; let go by close() inside a deferred_interrupts block, as ThreadEngine._join says why
        self._thread: threading.Thread | None = threading.Thread(target=self._loop, name="tiermem-uring",
                                                                 daemon=True)
        try:
            with deferred_interrupts():  # no interrupt inside start(), where the thread runs but is not known
                self._thread.start()
        except BaseException:  # an interrupt (at the block's end) or no more threads: stop the loop, free the ring
            self.close()
            raise

    @property
    def submits(self) -> int:
        """System calls that submitted work, for the benchmark's batching figure."""
        return self._core.stats()["submits"]

    def core_stats(self) -> dict[str, int]:
        """The C core's counters: submits, chunks, fixed_chunks (in registered buffers), retries."""
        return self._core.stats()

    # -- caller side ---------------------------------------------------------------------------
    def _start(self, op: int, view: memoryview, address: int, pieces: list[Piece]) -> IOFuture:
        future = IOFuture(sum(p.length for p in pieces), 1, keepalive=view)
        uid = next(self._ids)
        xfers = [(address + p.buf_offset, p.offset, p.length, p.file.fd, p.file.buffered_fd,
                  ALIGN if p.file.direct else 0) for p in pieces]
        # listed and queued, or neither: an interrupt after the enqueue must not unlist a request the loop
        # will finish (it found no entry, and stopped), so it is delivered after the block
        with deferred_interrupts():
            self._live[uid] = (future, pieces, op)
            try:
                with self._calls:
                    if self.closed:
                        raise OSError(errno.ESHUTDOWN, "the io_uring engine is closed", pieces[0].file.path)
                    self._core.enqueue(uid, op, xfers, pieces[0].file.path)
            except BaseException:
                self._live.pop(uid, None)
                raise
        return future

    def register_buffers(self, regions: list[tuple[int, int]]) -> bool:
        """Register host regions as fixed buffers (split at 1 GiB); reads/writes inside them skip page pinning."""
        pieces = [(a + off, min(MAX_FIXED_BUFFER, n - off))
                  for a, n in regions for off in range(0, n, MAX_FIXED_BUFFER)]
        try:
            result = self._call("register", sorted(pieces))
        except OSError as exc:  # the engine is closed or its loop has stopped
            result = exc
        if isinstance(result, OSError):
            log.warning("io_uring could not register %s of fixed buffers (%s); using plain reads and writes",
                        format_size(sum(n for _, n in pieces)), result.strerror)
            return False
        return True

    def _call(self, what: str, arg: object) -> object:
        done = threading.Event()
        box: list[object] = []
        with self._calls:
            if self.closed:
                raise OSError(errno.ESHUTDOWN, "the io_uring engine is closed")
            self._control.append((what, arg, done, box))
            if threading.current_thread() is self._thread:  # from a completion callback: run it here
                self._run_control()
                return box[0] if box else None
            self._core.kick(stop=False)
        while not done.wait(0.5):
            thread = self._thread
            if thread is None or not thread.is_alive():
                raise OSError(errno.ESHUTDOWN, "the io_uring loop has stopped")
        return box[0] if box else None

    def close(self) -> None:
        """Wait for everything queued to finish, then tear the ring down."""
        with self._calls:
            if self.closed:
                return
            self.closed = True
            self._core.kick(stop=True)
        if threading.current_thread() is self._thread:
            raise OSError(errno.EDEADLK, "close() was called from an I/O completion callback; close the engine "
                          "from another thread")
        if self._thread is not None and self._thread.ident is not None:  # None: its start failed
            self._thread.join()
        with deferred_interrupts():  # the Thread object's death runs a weakref callback ([Note: interrupts])
            self._thread = None
        self._core.close()

    # -- the loop's side -----------------------------------------------------------------------
    def _run_control(self) -> None:
        while self._control:
            what, arg, done, box = self._control.popleft()
            try:
                if what == "register":
                    self._core.register_buffers(arg)  # type: ignore[arg-type]
            except (OSError, OverflowError, TypeError) as exc:
                box.append(exc if isinstance(exc, OSError) else OSError(errno.EINVAL, str(exc)))
            finally:
                done.set()

    def _finish(self, user_data: int, res: int, index: int, err_offset: int, err_len: int) -> None:
        future, pieces, op = self._live.pop(user_data)
        if res == 0:
            future._chunk_done(None)
        elif res == _native.ERR_EOF:
            future._chunk_done(past_end_error(pieces[index].file, err_len, err_offset))
        else:
            future._chunk_done(transfer_error(pieces[index].file, op, -res, err_len, err_offset))

    def _loop(self) -> None:
        core = self._core
        try:
            core.start()
            while (finished := core.run()) is not None:
                for done in finished:
                    self._finish(*done)
                if self._control:
                    self._run_control()
        except BaseException as exc:  # never leave a caller waiting forever
            log.exception("the io_uring loop failed")
            core.kick(stop=True)  # refuse new work from here on
            for uid in list(self._live):  # the core has waited for the kernel to finish with their buffers
                entry = self._live.pop(uid, None)
                if entry is not None:
                    entry[0]._chunk_done(OSError(errno.EIO, f"io_uring loop failed: {exc}", entry[1][0].file.path))
