"""A dependency-free progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Call with (done, total, label); `close()` ends the line."""

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self._last_draw = 0.0  # throttle terminal redraws to 10 per second
        self._last_decile = -1  # when not a terminal, one line per 10% step

    def __call__(self, done: int, total: int, label: str) -> None:
        frac = min(1.0, done / total) if total else 1.0
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw < 0.1 and frac < 1.0:
                return
            self._last_draw = now
            filled = int(frac * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r[{bar}] {frac:6.1%}  {label:<40.40}")
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(f"progress {frac:6.1%}  {label}\n")
                self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
