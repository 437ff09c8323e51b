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
- on the "pass" track, a span per pass (a top-level forward of the model and, when training, its backward;
  in generate(), the prefill and each decoding step) begun and ended while recording (`backward`);
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
import math
import os
import threading
import time
from collections.abc import Iterable
from typing import Any, TypeGuard

from tiermem.sizes import MAX_SIZE, short_repr

_FIXED_TRACKS = ("compute", "wait", "optimizer", "copy", "pass")  # the I/O tracks follow, one per directory and op
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
# [Note: reading a trace]
# A trace handed to `tiermem report` may be anything: another tool's JSON, a hand-edited or truncated file,
# /dev/zero. `load_trace` reads at most MAX_TRACE_BYTES (a regular file's size is checked first; the first
# bytes must open a JSON object, so a stream of zeros is refused at once) and turns JSON nested past what
# Python's reader follows into a ValueError. `_check_event` then holds every event the report reads (the
# spans, "ph": "X", and the track names, "thread_name") to what `Tracer` writes: numbers finite and within
# MAX_TRACE_MICROSECONDS (so that sums stay finite), names strings, args an object. Any other event is
# skipped, as before. Each failure is a ValueError naming the event (`traceEvents[7].dur`) and what was
# expected, which the CLI prints as one line.
MAX_TRACE_BYTES = 1 << 30
MAX_TRACE_MICROSECONDS = 1e15  # about 31 years: far past any run, and sums of a billion spans stay finite
_HEAD_BYTES = 1 << 16


def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON of the trace file `path`, read as [Note: reading a trace] says. Raises OSError when the file
    cannot be read, ValueError when it is not a JSON object within the bounds; `summarize` checks the rest."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_TRACE_BYTES:
            raise ValueError(f"{size} bytes, more than the {MAX_TRACE_BYTES >> 30} GiB a report reads; trace a "
                             "shorter stretch with tm.trace(path)")
        data = f.read(_HEAD_BYTES)
        head = data.lstrip()
        if (head or len(data) < _HEAD_BYTES) and not head.startswith(b"{"):
            first = f"begins with {head[:1]!r}" if head else "is empty"
            raise ValueError(f"not a trace: it {first}, not a JSON object ('{{'); pass a file that trace.path or "
                             "tm.trace(path) wrote")
        data += f.read(MAX_TRACE_BYTES + 1 - len(data))  # no more, whatever the path turns out to be
    if len(data) > MAX_TRACE_BYTES:
        raise ValueError(f"more than the {MAX_TRACE_BYTES >> 30} GiB a report reads; trace a shorter stretch "
                         "with tm.trace(path)")
    try:
        trace = json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested deeper than Python's reader follows; a tiermem trace is a few levels "
                         "deep") from None
    if not isinstance(trace, dict):
        raise ValueError(f"not a trace: a JSON {type(trace).__name__}, not an object with traceEvents")
    return trace


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_event(i: int, e: object) -> None:
    """Refuse an event the report would read that `Tracer` could not have written (see [Note: reading a
    trace]), naming it."""
    where = f"traceEvents[{i}]"
    if not isinstance(e, dict):
        raise ValueError(f"{where}: expected an event object, got {short_repr(e)}")

    def refuse(key: str, expected: str) -> ValueError:
        got = f"got {short_repr(e[key])}" if key in e else "it is missing"
        return ValueError(f"{where}.{key}: expected {expected}; {got}")

    ph = e.get("ph")
    if ph == "M" and e.get("name") == "thread_name":
        if not isinstance(e.get("tid"), (int, str)):
            raise refuse("tid", "the track's thread id, an integer")
        if not isinstance(e.get("args"), dict) or not isinstance(e["args"].get("name"), str):
            raise refuse("args", '{"name": TRACK}, naming the track')
        return
    if ph != "X":
        return  # counters and other tools' events: not read
    if not isinstance(e.get("tid"), (int, str)):
        raise refuse("tid", "the thread id of the span's track, an integer")
    if not isinstance(e.get("name"), str):
        raise refuse("name", "the span's name, a string")
    for key, low in (("ts", -MAX_TRACE_MICROSECONDS), ("dur", 0.0)):
        value = e.get(key)
        if not _number(value) or not low <= value <= MAX_TRACE_MICROSECONDS:
            raise refuse(key, f"microseconds, a finite number from {low:g} to {MAX_TRACE_MICROSECONDS:g}")
    args = e.get("args", {})
    if not isinstance(args, dict):
        raise refuse("args", "an object")
    nbytes = args.get("bytes", 0)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= MAX_SIZE:
        raise ValueError(f"{where}.args.bytes: expected a byte count, an integer from 0 to {MAX_SIZE}; got "
                         f"{short_repr(nbytes)}")
    for key in ("unit", "partition"):
        value = args.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, str, type(None))):
            raise ValueError(f"{where}.args.{key}: expected a name or an index; got {short_repr(value)}")


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
    for i, e in enumerate(events):
        _check_event(i, e)
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


def _dir_of(track: str) -> str:
    """The swap directory of an I/O track ("nvme" for the one pair of tracks of older traces)."""
    return "nvme" if track in ("nvme read", "nvme write") else track.split(" ", 1)[1]


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


def summarize(trace: dict[str, Any], bench_cache: str | None = None) -> dict[str, Any]:
    """What a trace says: time busy computing, updating, waiting and moving bytes (seconds), how much of the
    I/O ran while compute did, the units waited for longest, the bandwidth achieved per direction and per swap
    directory against what `tiermem bench io` measured there (cached in `bench_cache`, default
    `bench_cache_path()`), the reasons compute waited, what a deeper prefetch window would have hidden, and
    what to change. Raises ValueError when `trace` is not a tiermem trace."""
    by_track, start, wall = _spans_by_track(trace)
    other = trace.get("otherData", {}) if isinstance(trace.get("otherData"), dict) else {}
    config = other.get("config", {}) if isinstance(other.get("config"), dict) else {}

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
        "copy_seconds": _length(busy("copy")) / 1e6,
        "io_busy_seconds": _length(io) / 1e6,
        "io_overlapped_with_compute": _overlap(io, working) / _length(io) if io else None,
        "waits_by_unit": dict(sorted(((k, v / 1e6) for k, v in waits.items()), key=lambda kv: -kv[1])[:5]),
    }
    out.update(_bandwidth(by_track, other, config, bench_cache))
    out["passes"] = _passes(by_track, out["bandwidth"])
    classified = _classify_waits(by_track)
    out["wait_reasons"] = _wait_reasons(classified)
    out["deeper_window"] = _deeper_window(by_track, classified, config)
    out["advice"] = _advice(out, config)
    return out


# -- achieved bandwidth against `tiermem bench io` -----------------------------------------------------------
def _bandwidth(by_track: dict[str, list[dict[str, Any]]], other: dict[str, Any], config: dict[str, Any],
               bench_cache: str | None) -> dict[str, Any]:
    """read_/write_bytes and _gbps (all directories, while any transfer of that direction was in flight), and
    "bandwidth": the same per direction and per directory, each beside the cached `tiermem bench io` figure
    for its filesystem ("bench_gbps", "of_bench") or the command that measures it ("bench_note")."""
    from tiermem.io.bandwidth import cached_bandwidth

    named = other.get("io_tracks", {}) if isinstance(other.get("io_tracks"), dict) else {}
    nvme = config["nvme"] if isinstance(config.get("nvme"), dict) else {}
    configured = _paths(nvme.get("paths", []), "otherData.config.nvme.paths")
    out: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    per_op: dict[str, dict[str, Any]] = {}

    def figures(op: str, tracks: list[str], paths: list[str]) -> dict[str, Any]:
        nbytes = sum(e.get("args", {}).get("bytes", 0) for t in tracks for e in by_track[t])
        seconds = _length(_union([(e["ts"], e["ts"] + e["dur"]) for t in tracks for e in by_track[t]])) / 1e6
        gbps = nbytes / seconds / 1e9 if seconds > 0 else None
        cached = cached_bandwidth(paths, bench_cache) if paths else None
        bench = cached.get(f"{op}_gbps") if cached else None
        row: dict[str, Any] = {"op": op, "paths": paths, "bytes": nbytes, "busy_seconds": seconds, "gbps": gbps,
                               "bench_gbps": bench, "of_bench": gbps / bench if gbps and bench else None}
        if bench is None:
            where = " ".join(f"--path {p}" for p in paths) if paths else "--path DIR"
            row["bench_note"] = f"run tiermem bench io {where}"
        return row

    for op in _OPS:
        tracks = _io_tracks(by_track, op)
        paths: list[str] = []
        for track in tracks:
            path = named.get(track, {}).get("path") if isinstance(named.get(track), dict) else None
            if path is not None:
                path = _paths([path], f"otherData.io_tracks[{track!r}].path")[0]
            if path is None and track.startswith(f"{op} "):
                path = track[len(op) + 1:]
            track_paths = [path] if path else configured  # "nvme read" of older traces: every configured path
            if by_track[track]:
                rows.append({"track": track, **figures(op, [track], track_paths)})
            paths += [p for p in track_paths if p not in paths]
        per_op[op] = figures(op, tracks, paths)
        out[f"{op}_bytes"] = per_op[op]["bytes"]
        out[f"{op}_gbps"] = per_op[op]["gbps"]
    out["bandwidth"] = {**per_op, "by_path": rows}
    return out


def _paths(value: object, where: str) -> list[str]:
    """The directories a trace's otherData names, refused (naming `where`) unless a list of paths."""
    if not isinstance(value, list) or not all(isinstance(p, str) and p and "\0" not in p for p in value):
        raise ValueError(f"{where}: expected a list of directories, got {short_repr(value)}")
    return value


# -- passes ------------------------------------------------------------------------------------------------------
# [Note: passes in a report]
# A pass is one top-level forward and, when training, its backward: a training step without its optimizer
# step, or in generate() the prefill and then one decoding step each. The first pass records the order and,
# in generate(), has a different shape, so the report gives it apart and the median of the others. For each
# pass: its length, the share of it with any transfer in flight (the disk's busy share), the bytes of the
# reads and writes that began in it (its span ends once it has issued the next pass's first reads) or since
# the pass before it ended (a read-ahead that a finished write-back lets start between two passes; what
# began before the first pass counts in none), and their rate while in flight. Its floor is the time those bytes take at
# what `tiermem bench io` measured on the same directories, reads then writes (a drive does them in turn): a
# pass near its floor is disk-bound, and only fewer bytes (more room to keep units, compressed weights) or
# faster drives make it shorter; a pass well above it waits for something else.
def _passes(by_track: dict[str, list[dict[str, Any]]], bandwidth: dict[str, Any]) -> dict[str, Any] | None:
    """Each traced pass's figures, the first apart and the median of the rest (see [Note: passes in a report]);
    None when the trace has no pass spans (a block that saw no pass begin and end, or a trace before them)."""
    import bisect
    import statistics

    spans = sorted(by_track["pass"], key=lambda e: e["ts"])
    if not spans:
        return None
    io = {op: sorted((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("bytes", 0)) for t in _io_tracks(by_track, op)
                     for e in by_track[t]) for op in _OPS}
    starts = {op: [a for a, _, _ in io[op]] for op in _OPS}  # for each pass, its transfers by bisection
    busy_all = _union([(a, b) for op in _OPS for a, b, _ in io[op]])
    busy_starts, busy_ends = [a for a, _ in busy_all], [b for _, b in busy_all]
    rates = {op: bandwidth[op].get("bench_gbps") for op in _OPS}
    rows = []
    since = spans[0]["ts"]  # where the pass before ended: what began after it counts in this one
    for e in spans:
        p0, p1 = e["ts"], e["ts"] + e["dur"]
        near = busy_all[bisect.bisect_right(busy_ends, p0):bisect.bisect_left(busy_starts, p1)]  # those overlapping
        row: dict[str, Any] = {"seconds": e["dur"] / 1e6, "backward": bool(e.get("args", {}).get("backward")),
                               "io_busy_share": _overlap(near, [(p0, p1)]) / e["dur"] if e["dur"] else 0.0}
        floor: float | None = 0.0
        for op in _OPS:
            began = io[op][bisect.bisect_left(starts[op], since):bisect.bisect_left(starts[op], p1)]
            nbytes = sum(n for _, _, n in began)
            seconds = _length(_union([(a, b) for a, b, _ in began])) / 1e6
            row[f"{op}_bytes"] = nbytes
            row[f"{op}_gbps"] = nbytes / seconds / 1e9 if seconds > 0 else None
            if nbytes and floor is not None:
                floor = floor + nbytes / (rates[op] * 1e9) if rates[op] else None
        row["floor_seconds"] = floor
        row["of_floor"] = row["seconds"] / floor if floor else None
        rows.append(row)
        since = p1
    rest = rows[1:]

    def median(key: str) -> float | None:
        xs = [r[key] for r in rest if r[key] is not None]
        return statistics.median(xs) if xs else None

    summary = {key: median(key) for key in ("seconds", "io_busy_share", "read_bytes", "read_gbps", "write_bytes",
                                            "write_gbps", "floor_seconds", "of_floor")}
    if rest:
        summary.update(count=len(rest), seconds_min=min(r["seconds"] for r in rest),
                       seconds_max=max(r["seconds"] for r in rest))
    return {"count": len(rows), "first": rows[0], "rest": summary if rest else None, "each": rows}


# -- why compute waited ----------------------------------------------------------------------------------------
# [Note: wait reasons]
# Each wait span is put down to one reason, from the spans around it:
# - "state": an update waited for its unit's optimizer state (kind "state");
# - "gather": the unit is gathered from several ranks (gather true);
# - "not_issued": the unit's read began only once it was needed (at or after the wait began): the prefetch
#   window did not reach it in time (too small, or no room in it);
# - "in_flight": its read was issued before it was needed and was still in flight: the disk was the limit,
#   unless it was idle before the read was issued (which `_deeper_window` measures);
# - "other": no read of it overlapped the wait (a copy to the device, room being made).
# `_deeper_window` estimates what prefetch.depth + 1 would have hidden: a window one unit deeper issues each
# unit's read one acquisition earlier (an acquisition: a unit's forward or backward fetch, the start of its
# wait or of its compute). For each "not_issued" and "in_flight" wait, the read could have started that much
# earlier only as far as its directories' disk was idle in between (transfers queue behind the ones already
# there), and it hides at most the part of the wait before the read ended. An estimate: it assumes the window
# had room for one unit more, and it takes the read to last as long when issued earlier.
_REASONS = {
    "not_issued": "read not yet issued when the unit was needed (prefetch window too small or too late)",
    "in_flight": "read issued but still in flight when needed (disk-bound)",
    "gather": "waiting for the unit's gather from the other ranks",
    "state": "the lazy update waiting for the unit's optimizer state to be read",
    "other": "other (a copy to the device, room being made in host memory)",
}


def _reads(by_track: dict[str, list[dict[str, Any]]]) -> dict[str, list[tuple[float, float, list[str]]]]:
    """Each partition's reads: (start, end, their tracks), a striped transfer's spans merged into one."""
    merged: dict[tuple[str, float], list[Any]] = {}
    for track in _io_tracks(by_track, "read"):
        for e in by_track[track]:
            got = merged.setdefault((e["name"], e["ts"]), [e["ts"], e["ts"] + e["dur"], []])
            got[1] = max(got[1], e["ts"] + e["dur"])
            got[2].append(track)
    out: dict[str, list[tuple[float, float, list[str]]]] = {}
    for (name, _), (a, b, tracks) in merged.items():
        out.setdefault(name, []).append((a, b, tracks))
    return out


def _classify_waits(by_track: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every wait span with its reason (see [Note: wait reasons]) and, for those put down to a read, the read."""
    reads = _reads(by_track)
    out = []
    for e in by_track["wait"]:
        args = e.get("args", {})
        w0, w1 = e["ts"], e["ts"] + e["dur"]
        read = None
        if args.get("kind") == "state":
            reason = "state"
        elif args.get("gather"):
            reason = "gather"
        else:
            part = args.get("partition") or e["name"].removeprefix("wait ")
            overlapping = [r for r in reads.get(part, []) if r[0] < w1 and r[1] > w0]
            if overlapping:
                read = min(overlapping)
                reason = "not_issued" if read[0] >= w0 else "in_flight"
            else:
                reason = "other"
        out.append({"start": w0, "end": w1, "reason": reason, "read": read, "name": e["name"]})
    return out


def _wait_reasons(classified: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seconds and count of waits per reason, the largest first."""
    total: dict[str, list[float]] = {}
    for w in classified:
        got = total.setdefault(w["reason"], [0.0, 0])
        got[0] += w["end"] - w["start"]
        got[1] += 1
    whole = sum(v[0] for v in total.values())
    return [{"reason": r, "what": _REASONS[r], "seconds": v[0] / 1e6, "waits": int(v[1]),
             "share": v[0] / whole if whole else 0.0}
            for r, v in sorted(total.items(), key=lambda kv: -kv[1][0])]


def _acquisitions(by_track: dict[str, list[dict[str, Any]]]) -> list[float]:
    """When each unit's fetch began: its compute span's start, or the start of the wait that ended there."""
    waits_ending = {(e.get("args", {}).get("unit"), round(e["ts"] + e["dur"], 1)): e["ts"] for e in by_track["wait"]
                    if e.get("args", {}).get("kind") != "state"}
    return sorted(waits_ending.get((e.get("args", {}).get("unit"), round(e["ts"], 1)), e["ts"])
                  for e in by_track["compute"])


def _deeper_window(by_track: dict[str, list[dict[str, Any]]], classified: list[dict[str, Any]],
                   config: dict[str, Any]) -> dict[str, Any]:
    """What prefetch.depth + 1 would have hidden of the waits (see [Note: wait reasons]): the depth from and
    to, the seconds hidden and the seconds of all waits."""
    import bisect

    prefetch = config.get("prefetch", {}) if isinstance(config.get("prefetch"), dict) else {}
    depth = prefetch.get("depth") if isinstance(prefetch.get("depth"), int) else None
    acquired = _acquisitions(by_track)
    busy_by_track = {t: _union([(e["ts"], e["ts"] + e["dur"]) for e in by_track[t]]) for t in _io_tracks(by_track)}
    dirs: dict[str, list[str]] = {}  # the tracks of each directory: its reads and its writes
    for track in busy_by_track:
        dirs.setdefault(_dir_of(track), []).append(track)
    hidden = 0.0
    for w in classified:
        if w["read"] is None:
            continue
        r0, r1, tracks = w["read"]
        j = bisect.bisect_right(acquired, r0 + 1.0) - 1  # the acquisition that issued it (1 µs of slack)
        if j < 1:
            continue  # nothing was fetched before: no earlier moment to issue it at
        earlier = acquired[j - 1]
        disk = _union([span for t in tracks for d in dirs[_dir_of(t)] for span in busy_by_track[d]])
        idle = (r0 - earlier) - _overlap(disk, [(earlier, r0)])
        hidden += max(0.0, min(idle, min(w["end"], r1) - w["start"]))
    stall = sum(w["end"] - w["start"] for w in classified)
    return {"depth": depth, "to": depth + 1 if depth is not None else None, "hidden_seconds": hidden / 1e6,
            "wait_seconds": stall / 1e6}


def _s(seconds: float) -> str:
    return f"{seconds:.3g} s"


def _advice(s: dict[str, Any], config: dict[str, Any]) -> list[str]:
    wall, wait, io = s["wall_seconds"], s["wait_seconds"], s["io_busy_seconds"]
    if wall <= 0 or wait < 0.05 * wall:
        return [f"compute-bound: waits are {_s(wait)} of {_s(wall)}; I/O settings have little to gain"]
    lines = []
    deeper = s["deeper_window"]
    stall = deeper["wait_seconds"]
    if stall > 0 and deeper["hidden_seconds"] >= 0.05 * stall:
        change = f"{deeper['depth']} -> {deeper['to']}" if deeper["depth"] is not None else "+1"
        lines.append(f"prefetch.depth {change} would have hidden {_s(deeper['hidden_seconds'])} of {_s(stall)} "
                     "stall: reads were issued late while the disk was idle (raise memory.host_budget too if the "
                     "window has no room for one unit more)")
    reasons = {r["reason"]: r for r in s["wait_reasons"]}
    read = s["bandwidth"]["read"]
    disk_bound = "in_flight" in reasons and reasons["in_flight"]["share"] >= 0.5
    if disk_bound or io >= 0.9 * wall:
        against = (f" against {read['bench_gbps']:.2f} GB/s that tiermem bench io measured there"
                   if read.get("bench_gbps") else f" ({read['bench_note']} to compare)" if read.get("bench_note")
                   else "")
        what = (f"{_s(reasons['in_flight']['seconds'])} of the waits were reads in flight" if disk_bound else
                f"transfers were in flight {io / wall:.0%} of the time")
        lines.append(f"I/O-bound: {what} (read {(s['read_gbps'] or 0):.2f} GB/s{against}, write "
                     f"{(s['write_gbps'] or 0):.2f} GB/s): add drives to nvme.paths, or raise memory.host_budget "
                     "so that more stays in host memory")
    if "state" in reasons and reasons["state"]["share"] >= 0.3:
        lines.append(f"the lazy update waited {_s(reasons['state']['seconds'])} for optimizer state: raise "
                     "memory.host_budget so that its reads start earlier, or set optimizer.tier cpu if it fits")
    if not lines:
        depth = config.get("prefetch", {}).get("depth") if isinstance(config.get("prefetch"), dict) else None
        now = f" from {depth} to {depth + 1}" if isinstance(depth, int) else ""
        lines.append(f"waits are {_s(wait)} of {_s(wall)} while transfers were in flight only {io / wall:.0%} of "
                     f"the time: the reads start too late; raise prefetch.depth{now} (and memory.host_budget if "
                     "the window does not fit)")
    return lines
