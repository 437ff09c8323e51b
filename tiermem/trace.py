"""Timeline traces: what computed, what moved and what waited, as a Chrome trace / Perfetto JSON file.

# [Note: traces]
With `trace.path` set (written when the context ends) or inside `with tm.trace(path):` (written when the
block ends), tiermem records:
- on the "compute" track, a span per unit's forward and backward (from the moment it is usable on the
  device until it is released) and, on the "optimizer" track, a span per unit's update;
- on the "wait" track, a span for each time compute waited for a unit (its read, its gather: `partition`,
  `gather`) and for each time an update waited for its unit's state to be read (`kind: "state"`);
- on the "copy" track, a span per host<->device copy (`bytes`, `to`). There are none on the CPU device,
  whose device tier is the host buffer; on CUDA a span is the copy's submission to the side stream;
- one track per swap directory and direction, "read DIR" and "write DIR", with a span per transfer's
  pieces on that directory (the store's stripes) from submission to the transfer's completion: its
  partition, `bytes`, `tier` ("nvme->host", "host->nvme"), swap `file` and `offset` in it, `ok`;
- counters of the bytes each tier holds (host, device, nvme), sampled at every acquisition and at every
  transfer's completion.
Times are microseconds from the start of recording. Events are appended to a list under a lock (the I/O
engine's completions arrive on its thread) and written once, as {"traceEvents": [...]}: the format
ui.perfetto.dev and chrome://tracing open. The file also carries the run's config and which directory
each I/O track is ("otherData"), so that `tiermem report TRACE` (`summarize`) can say which setting to
change and compare each directory with what `tiermem bench io` measured there. Recording is a few
dictionary appends per unit and per transfer; nothing is recorded without a tracer.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

_FIXED_TRACKS = ("compute", "wait", "optimizer", "copy")  # the I/O tracks follow, one per directory and op
_OPS = ("read", "write")


class Tracer:
    """Collects trace events in memory; `write` puts them in a file."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self.config = config or {}  # the run's settings, for the report's advice
        self._tids = {t: k + 1 for k, t in enumerate(_FIXED_TRACKS)}  # track -> the Chrome trace's thread id
        self._io_tracks: dict[tuple[str, str], str] = {}  # (op, swap file) -> its track, "read DIR"
        self.io_paths: dict[str, dict[str, str]] = {}  # I/O track -> {"op", "path"}, for the report

    def now(self) -> float:
        """Microseconds since recording started."""
        return (time.perf_counter() - self._t0) * 1e6

    def _tid(self, track: str) -> int:
        tid = self._tids.get(track)
        if tid is None:
            with self._lock:
                tid = self._tids.setdefault(track, len(self._tids) + 1)
        return tid

    def span(self, track: str, name: str, start: float, end: float | None = None, **args: Any) -> None:
        """A span on `track` from `start` to `end` (default: now), in microseconds."""
        end = self.now() if end is None else end
        event = {"name": name, "ph": "X", "pid": 1, "tid": self._tid(track), "ts": round(start, 3),
                 "dur": round(max(0.0, end - start), 3), "args": args}
        with self._lock:
            self.events.append(event)

    def transfer(self, op: str, partition: str, began: float, pieces: Iterable[Any], *, ok: bool) -> None:
        """A read or write of `partition` that began at `began` and ended now: a span on each swap directory's
        track ("read DIR"/"write DIR") with the bytes of the store's `pieces` (engine Pieces) that are there."""
        end = self.now()
        per_file: dict[str, list[int]] = {}  # swap file -> [bytes, offset of its first piece]
        for piece in pieces:
            got = per_file.get(piece.file.path)
            if got is None:
                per_file[piece.file.path] = [piece.length, piece.offset]
            else:
                got[0] += piece.length
        tier = "nvme->host" if op == "read" else "host->nvme"
        for file, (nbytes, offset) in per_file.items():
            track = self._io_tracks.get((op, file))
            if track is None:  # the swap file is DIR/<run directory>/<file>: the track names DIR
                path = os.path.dirname(os.path.dirname(file))
                track = self._io_tracks[(op, file)] = f"{op} {path}"
                self.io_paths[track] = {"op": op, "path": path}
            self.span(track, partition, began, end, bytes=nbytes, tier=tier, file=file, offset=offset, ok=ok)

    def copy(self, to: str, partition: str, began: float, nbytes: int) -> None:
        """A host<->device copy of `partition` (`to`: "device" or "host") that began at `began`, ended now."""
        self.span("copy", f"to {to} {partition}", began, bytes=nbytes, to=to)

    def counter(self, name: str, values: dict[str, int]) -> None:
        event = {"name": name, "ph": "C", "pid": 1, "ts": round(self.now(), 3), "args": values}
        with self._lock:
            self.events.append(event)

    def held(self, ledger: Any, store: Any | None) -> None:
        """The "bytes held" counter: host and device bytes from the swapper's ledger, NVMe bytes in the
        store's live extents (0 before the store is opened)."""
        self.counter("bytes held", {"host": ledger.now("host"), "device": ledger.now("device"),
                                    "nvme": store.used if store is not None else 0})

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write the trace (atomically: a temporary file, then a rename); returns the path."""
        with self._lock:
            events = list(self.events)
            tids = dict(self._tids)
        names: list[dict[str, Any]] = []
        for track, tid in tids.items():
            names.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}})
            names.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        names.append({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "tiermem"}})
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": names + events, "displayTimeUnit": "ms",
                       "otherData": {"config": self.config, "io_tracks": dict(self.io_paths)}}, f)
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
    by_track: dict[str, list[dict[str, Any]]] = {t: [] for t in _FIXED_TRACKS}
    for track in tracks.values():
        if _io_op(track):
            by_track.setdefault(track, [])
    for e in events:
        if e.get("ph") == "X" and tracks.get(e.get("tid")) in by_track:
            by_track[tracks[e["tid"]]].append(e)
    spans = [e for es in by_track.values() for e in es]
    if not spans:
        raise ValueError("the trace has no spans: nothing ran while it was recorded")
    start = min(e["ts"] for e in spans)
    return by_track, start, max(e["ts"] + e["dur"] for e in spans) - start


def _io_op(track: str) -> str | None:
    """"read" or "write" for an I/O track ("read DIR", or the "nvme read" of traces before one per
    directory), else None."""
    for op in _OPS:
        if track.startswith(f"{op} ") or track == f"nvme {op}":
            return op
    return None


def _io_tracks(by_track: dict[str, list[dict[str, Any]]], op: str | None = None) -> list[str]:
    """The I/O tracks (of direction `op`, or both), in the order they first appeared."""
    return [t for t in by_track if _io_op(t) and (op is None or _io_op(t) == op)]


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
        rows = [t for t in ("compute", "optimizer", "wait", "copy", *_io_tracks(by_track)) if by_track[t]]
        colors = {"compute": "tab:blue", "optimizer": "tab:green", "wait": "tab:red", "copy": "tab:gray"}
        colors.update({t: "tab:orange" if _io_op(t) == "read" else "tab:purple" for t in _io_tracks(by_track)})
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
    io = _union([span for t in _io_tracks(by_track) for span in busy(t)])
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
    for key in _OPS:
        tracks = _io_tracks(by_track, key)
        nbytes = sum(e["args"].get("bytes", 0) for t in tracks for e in by_track[t])
        t = _length(_union([span for track in tracks for span in busy(track)])) / 1e6
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
