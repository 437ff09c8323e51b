"""The one module that imports the cffi io_uring core; it turns negative errno into OSError and nothing else."""

from __future__ import annotations

import os
from typing import Any

try:  # the extension is absent where liburing was missing at install time
    from tiermem.io._uring_cffi import ffi, lib  # type: ignore[import-not-found,unused-ignore]

    IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the build machine
    ffi = lib = None
    IMPORT_ERROR = (
        f"the native io_uring core is not built ({exc}); install Debian's liburing-dev and reinstall tiermem"
    )

OP_READ = 0
OP_WRITE = 1
OP_NOP = 2


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


class Ring:
    """An owned io_uring instance; a context manager. Methods map 1:1 to csrc/tm_uring.c."""

    def __init__(self, entries: int, *, sqpoll: bool = False, sq_idle_ms: int = 1000) -> None:
        if lib is None:
            raise OSError(0, IMPORT_ERROR or "io_uring core missing")
        out = ffi.new("struct tm_ring **")
        check(lib.tm_ring_open(entries, 1 if sqpoll else 0, sq_idle_ms, out), "io_uring_queue_init")
        self._ring: Any = out[0]  # the C handle; NULL after close()
        self.entries: int = lib.tm_ring_sq_entries(self._ring)

    def register_buffers(self, regions: list[tuple[int, int]]) -> None:
        addrs = ffi.new("uint64_t[]", [a for a, _ in regions])
        lens = ffi.new("uint64_t[]", [n for _, n in regions])
        check(lib.tm_ring_register_buffers(self._ring, addrs, lens, len(regions)), "io_uring_register_buffers")

    def unregister_buffers(self) -> None:
        check(lib.tm_ring_unregister_buffers(self._ring), "io_uring_unregister_buffers")

    def submit(self, reqs: Any, n: int) -> int:
        """Queue `n` entries of the cdata array `reqs` and submit once; return how many were queued."""
        return check(lib.tm_ring_submit(self._ring, reqs, n), "io_uring_submit")

    def reap(self, out: Any, max_n: int, wait_nr: int) -> int:
        return check(lib.tm_ring_reap(self._ring, out, max_n, wait_nr), "io_uring_wait_cqe")

    def close(self) -> None:
        if self._ring is not None:
            lib.tm_ring_close(self._ring)
            self._ring = None

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
