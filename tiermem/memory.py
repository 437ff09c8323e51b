"""Giving freed host memory back to the OS, so resident memory follows tiermem's budget.

glibc keeps freed heap memory for reuse, and after a large free it raises its mmap threshold, so the
memory of a model whose parameters tiermem has moved to swap, or of a step's gradients, stays resident
although nothing uses it. `trim()` asks glibc to return it (malloc_trim); it is cheap when there is
little to give back, and a no-op where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def _load_trim() -> object | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_trim()


def trim() -> None:
    """Return freed heap memory to the OS (glibc's malloc_trim(0))."""
    if _malloc_trim is not None:
        _malloc_trim(0)  # type: ignore[operator]
