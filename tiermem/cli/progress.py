"""Progress bars on stderr for long CLI work (`tiermem bench io`, the demo), drawn by tqdm; hidden when
stderr is not a terminal, so logs and pipes get no bar lines."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm


class ProgressBar:
    """Call with (done, total, label) as work advances; `close()` ends the bar. Nothing is drawn when the
    stream is not a terminal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.shown = self.stream.isatty()
        self._bar: Any = None  # made at the first call, when the total is known

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.shown:
            return
        if self._bar is None or self._bar.total != total:
            self.close()
            self._bar = tqdm(total=total, file=self.stream, leave=True, dynamic_ncols=True, mininterval=0.1)
        self._bar.set_description_str(label, refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
