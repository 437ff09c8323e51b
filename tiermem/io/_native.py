"""The one module that imports the cffi io_uring core; it turns negative errno into OSError and nothing else."""

from __future__ import annotations

import errno
import os
from typing import Any

from tiermem.io.engine import OP_READ, OP_WRITE

try:  # the extension is absent where liburing was missing at install time
    from tiermem.io._uring_cffi import ffi, lib  # type: ignore[import-not-found,unused-ignore]

    IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the build machine
    ffi = lib = None
    IMPORT_ERROR = (
        f"the native io_uring core is not built ({exc}); install Debian's liburing-dev and reinstall tiermem"
    )

# The C core's codes, taken from csrc/tm_uring.h rather than written again here.
ERR_EOF: int | None = None if lib is None else int(lib.TM_ERR_EOF)  # tm_done.res of a read past the file's end
_C_OPS: dict[int, int] = {} if lib is None else {OP_READ: int(lib.TM_OP_READ), OP_WRITE: int(lib.TM_OP_WRITE)}

# one piece of a request: (address, file offset, length, fd, buffered fd, alignment for the direct fd)
Xfer = tuple[int, int, int, int, int, int]
# struct tm_done, one finished request: (user_data, res: 0, -errno or ERR_EOF, index of the failed piece,
# file offset and bytes left of its first failed chunk)
Done = tuple[int, int, int, int, int]


def check(ret: int, what: str, path: str | None = None) -> int:
    """Return `ret` when it is >= 0, else raise OSError(errno, strerror, path) for the negative errno."""
    if ret < 0:
        raise OSError(-ret, f"{what}: {os.strerror(-ret)}", path)
    return ret


def probe() -> str | None:
    """Return None when io_uring can be used here, else the reason it cannot."""
    if lib is None:
        return IMPORT_ERROR
    if os.environ.get("TIERMEM_DISABLE_IO_URING", "") not in ("", "0"):
        return "disabled by the environment variable TIERMEM_DISABLE_IO_URING"
    disabled = _read_sysctl("/proc/sys/kernel/io_uring_disabled")
    if disabled == "2":
        return "io_uring is disabled by the kernel setting kernel.io_uring_disabled=2"
    ret = lib.tm_ring_probe()
    if ret < 0:
        return f"the kernel refused to create an io_uring ring: {os.strerror(-ret)}"
    return None


def _read_sysctl(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


class NativeEngine:
    """The C transfer pipeline (csrc/tm_uring.c); methods map 1:1 to its functions."""

    def __init__(self, queue_depth: int, block_size: int, *, sqpoll: bool = False, sq_idle_ms: int = 1000) -> None:
        if lib is None:
            raise OSError(0, IMPORT_ERROR or "io_uring core missing")
        out = ffi.new("struct tm_engine **")
        check(lib.tm_engine_open(queue_depth, block_size, 1 if sqpoll else 0, sq_idle_ms, out),
              "io_uring_queue_init")
        self.handle: Any = out[0]  # the C handle; NULL after close()
        self._done = ffi.new("struct tm_done[]", 2 * (queue_depth + 1))  # what run() copies finished work into

    def start(self) -> None:
        """First thing on the loop's thread: makes that thread the ring's one issuer."""
        check(lib.tm_engine_start(self.handle), "io_uring_enable_rings")

    def enqueue(self, user_data: int, op: int, xfers: list[Xfer], path: str) -> None:
        """Queue one request of pieces (any thread), `op` being OP_READ or OP_WRITE; `run` reports it once,
        under `user_data`."""
        c_op = _C_OPS[op]
        pieces = ffi.new("struct tm_xfer[]", [(a, off, n, fd, bfd, c_op, align) for a, off, n, fd, bfd, align in xfers])
        check(lib.tm_engine_enqueue(self.handle, user_data, pieces, len(xfers)), "cannot queue the transfer", path)

    def run(self) -> list[Done] | None:
        """Block (GIL released) until requests finish and return them, [] after a kick, None once stopped and
        drained."""
        got = lib.tm_engine_run(self.handle, self._done, len(self._done))
        if got == -errno.ESHUTDOWN:
            return None
        check(got, "io_uring")
        return [(d.user_data, d.res, d.err_index, d.err_offset, d.err_len) for d in self._done[0:got]]

    def kick(self, stop: bool) -> None:
        """Make `run` return soon; with stop, refuse new work and return None once the rest has finished."""
        lib.tm_engine_kick(self.handle, 1 if stop else 0)

    def register_buffers(self, regions: list[tuple[int, int]]) -> None:
        """Only on the thread that calls run()."""
        addrs = ffi.new("uint64_t[]", [a for a, _ in regions])
        lens = ffi.new("uint64_t[]", [n for _, n in regions])
        check(lib.tm_engine_register_buffers(self.handle, addrs, lens, len(regions)), "io_uring_register_buffers")

    def stats(self) -> dict[str, int]:
        """Counters of the core: submit calls, chunks, chunks in registered buffers, resubmitted chunks."""
        out = ffi.new("uint64_t[]", lib.TM_NSTATS)
        lib.tm_engine_stats(self.handle, out)
        return dict(zip(("submits", "chunks", "fixed_chunks", "retries"), (int(v) for v in out), strict=True))

    def close(self) -> None:
        if self.handle is not None:
            lib.tm_engine_close(self.handle)
            self.handle = None
