"""Timeline traces: what computed, what moved and what waited, as a Chrome trace / Perfetto JSON file.

# [Note: traces]
With `trace.path` set (written when the context ends) or inside `with tm.trace(path):` (written when the
block ends), tiermem records:
- on the "compute" track, a span per unit's forward and backward (from the moment it is usable on the
  device until it is released) and, on the "optimizer" track, a span per unit's update;
- on the "wait" track, a span for each time compute waited for a unit (its read, its gather);
- on the "nvme read" and "nvme write" tracks, a span per transfer from submission to completion, with its
  partition, bytes and swap files;
- counters of the bytes each tier holds, sampled at every acquisition.
Times are microseconds from the start of recording. Events are appended to a list under a lock (the I/O
engine's completions arrive on its thread) and written once, as {"traceEvents": [...]}: the format
ui.perfetto.dev and chrome://tracing open.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

_TRACKS = ("compute", "wait", "optimizer", "nvme read", "nvme write")


class Tracer:
    """Collects trace events in memory; `write` puts them in a file."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []

    def now(self) -> float:
        """Microseconds since recording started."""
        return (time.perf_counter() - self._t0) * 1e6

    def span(self, track: str, name: str, start: float, end: float | None = None, **args: Any) -> None:
        """A span on `track` from `start` to `end` (default: now), in microseconds."""
        end = self.now() if end is None else end
        event = {"name": name, "ph": "X", "pid": 1, "tid": _TRACKS.index(track) + 1, "ts": round(start, 3),
                 "dur": round(max(0.0, end - start), 3), "args": args}
        with self._lock:
            self.events.append(event)

    def counter(self, name: str, values: dict[str, int]) -> None:
        event = {"name": name, "ph": "C", "pid": 1, "ts": round(self.now(), 3), "args": values}
        with self._lock:
            self.events.append(event)

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write the trace (atomically: a temporary file, then a rename); returns the path."""
        names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": k + 1, "args": {"name": t}}
                 for k, t in enumerate(_TRACKS)]
        names.append({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "tiermem"}})
        with self._lock:
            events = list(self.events)
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": names + events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
        return path
