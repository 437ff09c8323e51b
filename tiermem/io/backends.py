"""The backend choice: which engines work here, and building the one a setting asks for.

Kept apart from tiermem/io/engine.py so that the base class knows none of its subclasses.
"""

from __future__ import annotations

import logging
import threading

from tiermem.errors import IOEngineError
from tiermem.io import _native
from tiermem.io.engine import DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH, IOEngine
from tiermem.io.threads import ThreadEngine
from tiermem.io.uring import UringEngine

log = logging.getLogger(__name__)

BACKENDS = ("io_uring", "threads")

_probe_lock = threading.Lock()
_probe_result: dict[str, str | None] = {}  # backend -> None or why it is unusable; probed once per process
_fallback_logged = False  # the fallback warning is said once per process, not once per engine


def available_backends() -> dict[str, str | None]:
    """Each backend name mapped to None when usable here, else the reason it is not."""
    with _probe_lock:
        if not _probe_result:
            _probe_result["io_uring"] = _native.probe()
            _probe_result["threads"] = None
        return dict(_probe_result)


def create_engine(backend: str = "auto", *, block_size: int = DEFAULT_BLOCK_SIZE,
                  queue_depth: int = DEFAULT_QUEUE_DEPTH, sqpoll: bool = False) -> IOEngine:
    """Build an engine. `backend` is 'auto' (io_uring when usable, else threads), 'io_uring' or 'threads'.

    Example::

        with create_engine("auto", block_size=4 << 20) as engine, IOFile(path, "rw") as f:
            engine.write(f, buf).wait()
    """
    if backend not in ("auto", *BACKENDS):
        raise IOEngineError(f"io.engine: expected one of auto, io_uring, threads, got {backend!r}")
    reasons = available_backends()
    if backend == "auto":
        backend = "io_uring" if reasons["io_uring"] is None else "threads"
        if backend == "threads":
            _log_fallback(reasons["io_uring"])
    elif reasons[backend] is not None:
        raise IOEngineError(
            f"io.engine: {backend} is not usable here: {reasons[backend]}. Set io.engine to 'auto' or 'threads'"
        )
    if sqpoll and backend != "io_uring":
        raise IOEngineError("io.sqpoll: SQPOLL needs io.engine io_uring; set io.sqpoll to false")
    if backend == "io_uring":
        return UringEngine(block_size=block_size, queue_depth=queue_depth, sqpoll=sqpoll)
    return ThreadEngine(block_size=block_size, queue_depth=queue_depth)


def _log_fallback(reason: str | None) -> None:
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        log.warning("io_uring is not usable (%s); tiermem uses the threads backend", reason)
