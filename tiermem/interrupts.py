"""Ctrl-C held back for the few lines that must run together: a state change and the I/O it stands for.

# [Note: interrupts]
Python raises KeyboardInterrupt in the main thread between any two bytecodes. Landing between "this
partition is being read" and the submission of its read, it would leave a state that waits for I/O that
never started, and the exit that should restore the model would wait on it forever. `deferred_interrupts()`
puts a recording SIGINT handler in place for such a block; a signal that arrives inside is delivered to
the previous handler (raising KeyboardInterrupt, by default) as soon as the block ends, so the interrupt
still lands, only a few microseconds later and between consistent states. Outside the main thread, or
when SIGINT is ignored, it does nothing. Blocks nest.

A block runs around every read and write the swap layer queues and every unit's update, 107 a step on the
training bench, so it swaps the handler through `_signal`, the C module under `signal`: `signal.signal` and
`signal.getsignal` also turn what they return into an enum member, which for a Python function goes through
an exception inside enum's lookup. A block took 21-23 microseconds that way and takes 5 now (2.3 ms of the
bench's step against 0.6 ms).
"""

from __future__ import annotations

import _signal
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold back SIGINT for the block (see [Note: interrupts])."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = _signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN or SIG_DFL: nothing would raise in Python anyway
        yield
        return
    received: list[tuple[int, FrameType | None]] = []

    def record(signum: int, frame: FrameType | None) -> None:
        received.append((signum, frame))

    _signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, previous)
        if received:
            previous(*received[0])
