"""IOFuture: the small handle every asynchronous read or write returns."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tiermem.errors import IOTimeoutError

log = logging.getLogger(__name__)


class IOFuture:
    """Completion of one logical transfer that may have been split into several chunks.

    ``done()`` never blocks; ``wait()`` blocks until every chunk finished and re-raises the first
    error (an OSError naming the file). ``nbytes`` is the size of the transfer.
    """

    __slots__ = ("nbytes", "_remaining", "_error", "_done", "_gate", "_lock", "_callbacks", "_keepalive")

    def __init__(self, nbytes: int, chunks: int, keepalive: object = None) -> None:
        self.nbytes = nbytes
        self._remaining = chunks  # chunks still in flight; the future completes at zero
        self._error: BaseException | None = None  # first failure; later ones are dropped
        self._done = chunks == 0
        # held while not done: waiters block on it. A bare lock is much cheaper than threading.Event,
        # and every chunk of every transfer makes one of these.
        self._gate = threading.Lock()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[IOFuture], None]] | None = None  # run once, on completion
        self._keepalive = keepalive  # the caller's buffer stays alive while the kernel writes into it
        if not self._done:
            self._gate.acquire()

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> int:
        """Block until done; return the byte count or raise the transfer's error."""
        if not self._done:
            if not self._gate.acquire(timeout=-1 if timeout is None else timeout):
                raise IOTimeoutError(f"I/O of {self.nbytes} bytes did not finish within {timeout} s")
            self._gate.release()  # let every other waiter through too
        if self._error is not None:
            raise self._error
        return self.nbytes

    def exception(self) -> BaseException | None:
        """The transfer's error once done (None on success); does not block."""
        return self._error

    def add_done_callback(self, fn: Callable[[IOFuture], None]) -> None:
        """Call `fn(self)` when done (at once when already done), on the completing thread."""
        with self._lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def _chunk_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._remaining -= 1
            if self._remaining > 0:
                return
            self._keepalive = None
            callbacks, self._callbacks = self._callbacks, None
            self._done = True
            self._gate.release()
        if callbacks:
            for fn in callbacks:
                _run_callback(fn, self)


def _run_callback(fn: Callable[[IOFuture], None], future: IOFuture) -> None:
    """Run one done-callback; an exception is logged, never raised into the engine's thread, whose death
    would leave every other transfer waiting, and the other callbacks still run."""
    try:
        fn(future)
    except Exception:
        log.exception("an I/O completion callback raised; the transfer itself is unaffected")

