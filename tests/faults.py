"""A fault-injecting I/O engine for the fault tests (a test tool, not a user setting): a real engine that
fails chosen transfers (requests: a store's read or write of a partition is one) the way a failing or full
disk would, with the errno the kernel would give, or moves only part of their bytes (a short transfer the
engine could not complete)."""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

from tiermem.io.buffers import ALIGN
from tiermem.io.engine import OP_READ, OP_WRITE, IOEngine, Piece
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

    def _start(self, op: int, view: memoryview, address: int, pieces: list[Piece]) -> IOFuture:
        with self._lock:
            self._seen[op] += 1
            plan = self._plan.get(op)
            hit = plan is not None and (plan[0] is None or self._seen[op] in plan[0])
            if hit:
                self.failed[op] += 1
        if not hit:
            return self.inner._start(op, view, address, pieces)
        assert plan is not None
        nbytes = sum(p.length for p in pieces)
        fut = IOFuture(nbytes, 1)
        path = pieces[0].file.path
        if plan[1] != SHORT:
            fut._chunk_done(OSError(plan[1], os.strerror(plan[1]), path))
            return fut
        half = nbytes // 2 // ALIGN * ALIGN
        error = OSError(errno.EIO, f"short transfer: {half} of {nbytes} bytes", path)
        moving, left = [], half  # the first `half` bytes of the request, piece by piece
        for p in pieces:
            if left > 0:
                moving.append(p._replace(length=min(p.length, left)))
                left -= moving[-1].length
        if not moving:
            fut._chunk_done(error)
        else:
            moved = self.inner._start(op, view, address, moving)
            moved.add_done_callback(lambda f: fut._chunk_done(f.exception() or error))
        return fut

    def register_buffers(self, regions: list[tuple[int, int]]) -> bool:
        return self.inner.register_buffers(regions)

    def close(self) -> None:
        self.closed = True
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else the inner engine offers
        return getattr(self.inner, name)
