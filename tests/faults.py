"""A fault-injecting I/O engine for the fault tests (a test tool, not a user setting): a real engine that
fails chosen transfers the way a failing or full disk would, with the errno the kernel would give, or
moves only part of their bytes (a short transfer the engine could not complete)."""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

from tiermem.io.engine import OP_READ, OP_WRITE, IOEngine
from tiermem.io.files import IOFile
from tiermem.io.future import IOFuture

OPS = {"read": OP_READ, "write": OP_WRITE}
SHORT = -1  # fail(..., err=SHORT): half the bytes move, then the transfer fails


class FaultyEngine(IOEngine):
    """Passes every transfer to `inner`, except the ones `fail()` picks: those complete at once with an OSError
    and move no byte. Transfers are counted per kind from the last `fail()` call, starting at 1."""

    def __init__(self, inner: IOEngine) -> None:
        super().__init__(block_size=inner.block_size, queue_depth=inner.queue_depth)
        self.inner = inner
        self.name = f"faulty {inner.name}"
        self._lock = threading.Lock()
        self._seen = dict.fromkeys(OPS.values(), 0)  # transfers since the plan for that kind was set
        self._plan: dict[int, tuple[set[int] | None, int]] = {}  # kind -> (which, or None for all; errno)
        self.failed = dict.fromkeys(OPS.values(), 0)  # transfers failed so far, by kind

    def fail(self, kind: str, which: set[int] | None = None, err: int = errno.EIO) -> None:
        """Fail the transfers of `kind` ('read' or 'write') numbered in `which` from now on (None: all). With
        `err=SHORT` the first half of the bytes really moves, and the transfer then fails as short."""
        with self._lock:
            op = OPS[kind]
            self._seen[op] = 0
            self._plan[op] = (which, err)

    def heal(self) -> None:
        """Stop failing anything."""
        with self._lock:
            self._plan.clear()

    def _start(self, op: int, file: IOFile, view: memoryview, address: int, nbytes: int, offset: int) -> IOFuture:
        with self._lock:
            self._seen[op] += 1
            plan = self._plan.get(op)
            hit = plan is not None and (plan[0] is None or self._seen[op] in plan[0])
            if hit:
                self.failed[op] += 1
        if hit:
            assert plan is not None
            fut = IOFuture(nbytes, 1)
            if plan[1] == SHORT:
                half = max(nbytes // 2 // 4096 * 4096, 0)
                moved = self.inner._start(op, file, view, address, half, offset) if half else None
                error: OSError = OSError(errno.EIO, f"short transfer: {half} of {nbytes} bytes", file.path)
                if moved is None:
                    fut._chunk_done(error)
                else:
                    moved.add_done_callback(lambda f: fut._chunk_done(f.exception() or error))
            else:
                fut._chunk_done(OSError(plan[1], os.strerror(plan[1]), file.path))
            return fut
        return self.inner._start(op, file, view, address, nbytes, offset)

    def register_buffers(self, regions: list[tuple[int, int]]) -> bool:
        return self.inner.register_buffers(regions)

    def close(self) -> None:
        self.closed = True
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else the inner engine offers
        return getattr(self.inner, name)
