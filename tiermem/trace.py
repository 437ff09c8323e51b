"""Timeline traces: what computed, what moved and what waited, as a Chrome trace / Perfetto JSON file.

# [Note: traces]
With `trace.path` set (written when the context ends) or inside `with tm.trace(path):` (written when the
block ends), tiermem records:
- on the "compute" track, a span per unit's forward and backward (from the moment it is usable on the
  device until it is released) and, on the "optimizer" track, a span per unit's update;
- on the "wait" track, a span for each time compute waited for a unit (its read, its gather);
- on the "nvme read" and "nvme write" tracks, a span per transfer from submission to completion, with its
  partition, bytes and swap folders (`swap_dirs`);
- counters of the bytes each tier holds, sampled at every acquisition.
Times are microseconds from the start of recording. Events are appended to a list under a lock (the I/O
engine's completions arrive on its thread) and written once, as {"traceEvents": [...]}: the format
ui.perfetto.dev and chrome://tracing open. The file also carries the run's config ("otherData"), so
that `tiermem report TRACE` (`summarize`) can say which setting to change.
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

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self.config = config or {}  # the run's settings, for the report's advice

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
            json.dump({"traceEvents": names + events, "displayTimeUnit": "ms", "otherData": {"config": self.config}},
                      f)
        os.replace(tmp, path)
        return path


# -- reading a trace back: `tiermem report` ------------------------------------------------------------------
def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _spans_by_track(trace: Any) -> tuple[dict[str, list[dict[str, Any]]], float, float]:
    """The trace's spans per track, when the first began and how long they lasted in all (microseconds).
    Raises ValueError when `trace` is not a tiermem trace."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a trace: no traceEvents list (write one with trace.path or tm.trace(path))")
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by_track: dict[str, list[dict[str, Any]]] = {t: [] for t in _TRACKS}
    for e in events:
        if e.get("ph") == "X" and tracks.get(e.get("tid")) in by_track:
            by_track[tracks[e["tid"]]].append(e)
    spans = [e for es in by_track.values() for e in es]
    if not spans:
        raise ValueError("the trace has no spans: nothing ran while it was recorded")
    start = min(e["ts"] for e in spans)
    return by_track, start, max(e["ts"] + e["dur"] for e in spans) - start


def _waits_by_unit(by_track: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Microseconds compute waited for each unit, in all."""
    waits: dict[str, float] = {}
    for e in by_track["wait"]:
        name = e["name"].removeprefix("wait ")
        waits[name] = waits.get(name, 0.0) + e["dur"]
    return waits


def plot(trace: dict[str, Any], path: str | os.PathLike[str]) -> dict[str, float]:
    """Draw the trace into the PNG `path` (matplotlib): above, the timeline, a row per track (compute,
    updates, waits, reads, writes) with a bar per span; below, the seconds compute waited for each unit, a
    bar per unit in the order they were first waited for. Returns those seconds per unit. Raises ValueError
    when `trace` is not a tiermem trace, ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    by_track, start, wall = _spans_by_track(trace)
    stalls = {k: v / 1e6 for k, v in _waits_by_unit(by_track).items()}
    fig, (timeline, bars) = plt.subplots(2, 1, figsize=(12, 6.5), gridspec_kw={"height_ratios": [3, 2]})
    try:
        rows = [t for t in ("compute", "optimizer", "wait", "nvme read", "nvme write") if by_track[t]]
        colors = {"compute": "tab:blue", "optimizer": "tab:green", "wait": "tab:red", "nvme read": "tab:orange",
                  "nvme write": "tab:purple"}
        for y, track in enumerate(rows):
            timeline.broken_barh([((e["ts"] - start) / 1e6, e["dur"] / 1e6) for e in by_track[track]],
                                 (y - 0.4, 0.8), facecolors=colors[track])
        timeline.set_yticks(range(len(rows)), rows)
        timeline.invert_yaxis()
        timeline.set_xlim(0, wall / 1e6)
        timeline.set_xlabel("seconds from the start of recording")
        timeline.set_title("timeline (transfers overlap on their rows: one bar per transfer in flight)")
        names = list(stalls)
        bars.bar(range(len(names)), [stalls[n] for n in names], color="tab:red")
        bars.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        bars.set_ylabel("seconds waited")
        bars.set_title(f"waits per unit: {sum(stalls.values()):.3f} s in all" if names else "no waits recorded")
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=100)
    finally:
        plt.close(fig)
    return stalls


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    """What a trace says: time busy computing, updating, waiting and moving bytes (seconds), how much of the
    I/O ran while compute did, the units waited for longest, the bandwidth achieved per direction, and what
    to change. Raises ValueError when `trace` is not a tiermem trace."""
    by_track, start, wall = _spans_by_track(trace)

    def busy(track: str) -> list[tuple[float, float]]:
        return _union([(e["ts"], e["ts"] + e["dur"]) for e in by_track[track]])

    working = _union(busy("compute") + busy("optimizer"))
    io = _union(busy("nvme read") + busy("nvme write"))
    waits = _waits_by_unit(by_track)
    out: dict[str, Any] = {
        "wall_seconds": wall / 1e6,
        "compute_seconds": _length(busy("compute")) / 1e6,
        "update_seconds": _length(busy("optimizer")) / 1e6,
        "wait_seconds": _length(busy("wait")) / 1e6,
        "io_busy_seconds": _length(io) / 1e6,
        "io_overlapped_with_compute": _overlap(io, working) / _length(io) if io else None,
        "waits_by_unit": dict(sorted(((k, v / 1e6) for k, v in waits.items()), key=lambda kv: -kv[1])[:5]),
    }
    for track, key in (("nvme read", "read"), ("nvme write", "write")):
        nbytes = sum(e["args"].get("bytes", 0) for e in by_track[track])
        t = _length(busy(track)) / 1e6
        out[f"{key}_bytes"] = nbytes
        out[f"{key}_gbps"] = nbytes / t / 1e9 if t > 0 else None
    out["advice"] = _advice(out, trace.get("otherData", {}).get("config", {}))
    return out


def _advice(s: dict[str, Any], config: dict[str, Any]) -> list[str]:
    wall, wait, io = s["wall_seconds"], s["wait_seconds"], s["io_busy_seconds"]
    depth = config.get("prefetch", {}).get("depth")
    if wall <= 0 or wait < 0.05 * wall:
        return [f"compute-bound: waits are {wait:.3f} s of {wall:.3f} s; I/O settings have little to gain"]
    if io >= 0.9 * wall:
        return [f"I/O-bound: transfers were in flight {io / wall:.0%} of the time (read "
                f"{(s['read_gbps'] or 0):.2f} GB/s, write {(s['write_gbps'] or 0):.2f} GB/s): add drives to "
                "nvme.paths, or raise memory.host_budget so that more stays in host memory"]
    now = f" from {depth} to {depth + 1}" if isinstance(depth, int) else ""
    return [f"waits are {wait:.3f} s of {wall:.3f} s while transfers were in flight only {io / wall:.0%} of the "
            f"time: the reads start too late; raise prefetch.depth{now} (and memory.host_budget if the window "
            "does not fit)"]
