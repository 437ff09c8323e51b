"""Ctrl-C held back for the few lines that must run together: a state change and the I/O it stands for.

# [Note: interrupts]
Python raises KeyboardInterrupt in the main thread between any two bytecodes, and a SIGTERM handler that
calls `sys.exit()` (the usual way a job meets preemption) raises SystemExit the same way. Landing between
"this partition is being read" and the submission of its read, either would leave a state that waits for
I/O that never started, and the exit that should restore the model would wait on it forever.
`deferred_interrupts()` puts a recording handler in place of SIGINT's and SIGTERM's Python handlers for such
a block; the signals that arrive inside are delivered to the handlers that were in place (raising
KeyboardInterrupt, by default) in order as soon as the block ends, so they still land, only a few
microseconds later and between consistent states. Outside the main thread, or for a signal without a Python
handler (SIG_IGN, SIG_DFL: nothing would raise in Python anyway), it does nothing. Blocks nest: an inner
block inside an outer one changes nothing, the outer one delivers.

Putting two handlers back is not atomic: `signal.signal` runs the handlers of signals already pending before
it installs, so one handler put back can raise inside the call that was to put back the other. The
recorder therefore forwards to the handler it replaced once its block has ended: a recorder left in place
that way is a pass-through, never a sink.

The same blocks keep Python code that runs during teardown away from signals: CPython runs weakref
callbacks (a `weakref.finalize`, the WeakSet `threading` keeps of every Thread object) wherever an object
happens to die, and an exception raised there is printed as "Exception ignored in ..." and dropped. A Ctrl-C
or a SIGTERM handler's SystemExit landing in one is lost, and the job runs on. Objects whose death runs
such callbacks (the engines' worker threads) are dropped inside a block, so the signal is recorded there and
delivered at the block's end.

A block runs around every read and write the swap layer queues and every unit's update, 107 a step on the
training bench, so it swaps the handlers through `_signal`, the C module under `signal`: `signal.signal` and
`signal.getsignal` also turn what they return into an enum member, which for a Python function goes through
an exception inside enum's lookup.
"""

from __future__ import annotations

import _signal
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

HELD: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)  # the signals whose Python handlers a block holds back

_depth = 0  # blocks open on the main thread; an inner one leaves the work to the outermost

Handler = Callable[[int, "FrameType | None"], Any]


class deferred_interrupts:  # noqa: N801 - used as a function: `with deferred_interrupts():`
    """Hold back SIGINT and SIGTERM for the block (see [Note: interrupts]).

    A class, not a generator: the engines open one around every request, mostly inside a block the swap layer
    opened, and there the whole cost is the `_depth` test."""

    __slots__ = ("_swapped", "_received", "_holding")

    def __init__(self) -> None:
        self._swapped: list[tuple[int, Handler]] = []  # (signal, the handler it had), in the order replaced
        self._received: list[tuple[int, FrameType | None]] = []  # what arrived while held, in order
        # True from entry to exit of an outermost block on the main thread; afterwards the recorder forwards
        self._holding = False

    def __enter__(self) -> None:
        global _depth
        if _depth or threading.current_thread() is not threading.main_thread():
            return
        self._holding = True
        _depth += 1
        try:
            for signum in HELD:
                found = _signal.getsignal(signum)
                if callable(found):
                    self._swapped.append((signum, found))  # listed before it is replaced: put back in any case
                    _signal.signal(signum, self._record)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _depth
        if not self._holding:
            return
        self._holding = False
        _depth -= 1
        raised: BaseException | None = None
        for held, handler in self._swapped:
            try:
                _signal.signal(held, handler)
            except BaseException as error:  # noqa: BLE001 - a pending signal's handler raised; raised below
                raised = raised or error
        if raised is not None:
            raise raised
        for signum, frame in self._received:
            _deliver(self._swapped, signum, frame)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self._holding:
            self._received.append((signum, frame))
        else:  # left in place by an exit that a pending signal cut short (see the note)
            _deliver(self._swapped, signum, frame)


def _deliver(swapped: list[tuple[int, Handler]], signum: int, frame: FrameType | None) -> None:
    for held, handler in swapped:
        if held == signum:
            handler(signum, frame)
