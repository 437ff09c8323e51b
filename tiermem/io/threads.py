"""The portable backend: a fixed pool of threads doing os.preadv / os.pwritev (which drop the GIL)."""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading

from tiermem.errors import IOEngineError
from tiermem.interrupts import deferred_interrupts
from tiermem.io.engine import DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH, OP_READ, RETRYABLE, Chunk, IOEngine

log = logging.getLogger(__name__)

MAX_THREADS = 64


class ThreadEngine(IOEngine):
    """queue_depth worker threads (at most 64), each serving one chunk at a time."""

    name = "threads"

    def __init__(self, *, block_size: int = DEFAULT_BLOCK_SIZE, queue_depth: int = DEFAULT_QUEUE_DEPTH) -> None:
        super().__init__(block_size=block_size, queue_depth=queue_depth)
        self._queue: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()  # chunks waiting for a worker
        self._closing = threading.Lock()  # orders close() against callers queueing chunks
        # the Thread objects, started or not; dropped only inside a deferred_interrupts block (see _join)
        self._workers = [
            threading.Thread(target=self._work, name=f"tiermem-io-{i}", daemon=True)
            for i in range(min(queue_depth, MAX_THREADS))
        ]
        started = 0
        try:
            # Thread.start returns only once its thread runs: an interrupt landing in it would leave a worker
            # running but not counted, and one stop mark short (a join waiting forever), so none lands there
            # (by index: a local naming a Thread would outlive _join in the traceback, and drop it unguarded)
            with deferred_interrupts():
                while started < len(self._workers):
                    self._workers[started].start()
                    started += 1
        except BaseException:  # an interrupt (delivered at the block's end) or no more threads: stop them, fail
            with deferred_interrupts():
                self.closed = True
                self._mark_stop()
            self._join(started)
            raise

    def _submit(self, chunks: list[Chunk]) -> None:
        # all of a request's chunks or none (a future missing one never completes), and never behind the
        # workers' stop marks: that chunk would wait forever
        with deferred_interrupts(), self._closing:
            if self.closed:
                raise IOEngineError("the threads engine is closed")
            for chunk in chunks:
                self._queue.put(chunk)

    def _work(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None:
                return
            try:
                error = self._serve(chunk)
            except BaseException as exc:  # a worker must never die with a future left pending
                error = exc
            future = chunk.future
            # not kept while this worker waits for more: the chunk's view pins the caller's buffer (an
            # activation slot, say) until the next chunk comes, which may be never
            del chunk
            try:
                future._chunk_done(error)
            except BaseException:  # noqa: BLE001 - nothing may end a worker; callbacks log their own errors
                log.exception("completing an I/O future failed")

    @staticmethod
    def _serve(chunk: Chunk) -> BaseException | None:
        return _serve(chunk)

    def close(self) -> None:
        with deferred_interrupts():  # closed and every worker marked to stop, or neither
            with self._closing:
                if self.closed:
                    return
                self.closed = True
            self._mark_stop()
        self._join(len(self._workers))

    def _mark_stop(self) -> None:
        # one mark each, started or not (the marks no worker takes go with the queue); counted, not iterated:
        # a loop variable would hold the last Thread object past _join's block
        for _ in range(len(self._workers)):
            self._queue.put(None)

    def _join(self, started: int) -> None:
        """Wait for the first `started` workers (those running) to end, and let every Thread object go."""
        try:
            for i in range(started):
                self._workers[i].join()
        finally:
            # The last references to the Thread objects: their death runs `threading`'s WeakSet callback,
            # where a signal's exception would be dropped ([Note: interrupts]); inside the block it is delivered
            with deferred_interrupts():
                self._workers = []


def _serve(chunk: Chunk) -> BaseException | None:
    """Move the whole chunk, retrying short transfers and EAGAIN/EINTR; return the error, if any."""
    while chunk.length:
        fd = chunk.file.fd_for(chunk.address, chunk.offset, chunk.length)
        piece = chunk.view[chunk.view_offset : chunk.view_offset + chunk.length]
        try:
            if chunk.op == OP_READ:
                done = os.preadv(fd, [piece], chunk.offset)
            else:
                done = os.pwritev(fd, [piece], chunk.offset)
        except OSError as exc:
            if exc.errno in RETRYABLE:
                continue
            return chunk.error(exc.errno or 0)
        if done == 0:
            return chunk.past_end() if chunk.op == OP_READ else chunk.error(errno.ENOSPC)  # a write that moves nothing
        chunk.advance(done)
    return None
