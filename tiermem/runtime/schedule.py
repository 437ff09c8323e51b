"""The execution-order schedule: record the order units are used, then predict what comes next.

# [Note: prefetch window]
The first pass records the order in which units are acquired. Later acquisitions walk that order
cyclically (the next pass starts where the last one ended, so generate()'s steps chain), and each
acquisition returns the window: the next `depth` units of the order, cut where their bytes would pass
`max_bytes`. The runtime prefetches the window, keeps a released unit resident when the window holds
it again (tied weights, a layer used twice, an encoder reused by a decoder), and demotes idle resident
units outside it, so the device holds at most the units in use plus the window.

When an acquisition is not the predicted unit, it is a miss: the schedule resynchronises at the next
place that unit occurs in the order (a skipped layer); if the unit is not in the order at all, or
misses pile up in one pass (the order really changed: dynamic control flow, another input shape),
prediction stops for the rest of that pass and the whole next pass is recorded as the new order.
Results never depend on the schedule, only speed.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_MISSES_PER_PASS = 3


class Schedule:
    """Recorded unit order plus a cursor; counts hits, misses and re-recordings."""

    def __init__(self, depth: int, max_bytes: int | None, unit_bytes: Callable[[int], int]) -> None:
        self.depth = depth
        self.max_bytes = max_bytes
        self.unit_bytes = unit_bytes
        self.order: list[int] = []  # the recorded order; empty until the first pass ends
        self._recording: list[int] | None = []  # the order being recorded this pass, or None
        self._stale = False  # the order proved wrong this pass: record a fresh one from the next pass
        self.pos = 0  # index in `order` of the acquisition we expect next
        self.misses_this_pass = 0
        self.hits = 0  # acquisitions that matched the prediction
        self.misses = 0  # acquisitions that did not (and any made while recording after the first pass)
        self.retraces = 0  # times the order was recorded again
        self.resident: set[int] = set()  # units kept in host memory between passes (see plan_resident)
        self.stream_room: int | None = None  # with resident units or KV blocks: the bytes left for the units read in
        self.follow: dict[int, int] = {}  # unit -> bytes read with it (its KV blocks), as the plan saw them

    @property
    def recording(self) -> bool:
        return self._recording is not None

    def on_acquire(self, unit: int) -> list[int]:
        """Note that `unit` is being acquired; return the window of units to have ready next."""
        if self._recording is not None:
            self._recording.append(unit)
            return []
        if self._stale:
            self.misses += 1
            return []
        n = len(self.order)
        if self.order[self.pos % n] == unit:
            self.hits += 1
            self.pos = (self.pos + 1) % n
        else:
            self.misses += 1
            self.misses_this_pass += 1
            nxt = self._find(unit)
            if nxt is None or self.misses_this_pass > MAX_MISSES_PER_PASS:
                self._stale = True  # the order changed: record it anew, from the start of the next pass
                self.retraces += 1
                return []
            self.pos = (nxt + 1) % n
        return self.window()

    def next_in_pass(self) -> int | None:
        """The unit predicted next in this pass, or None (recording, the order went stale, or the pass is
        at its end: the next prediction would be the next pass's first unit)."""
        if self._recording is not None or self._stale or not self.order or self.pos == 0:
            return None
        return self.order[self.pos]

    def window(self) -> list[int]:
        """The next `depth` distinct units after the cursor, cut at `max_bytes`."""
        out: list[int] = []
        total = 0
        n = len(self.order)
        for k in range(n):
            if len(out) >= self.depth:
                break
            u = self.order[(self.pos + k) % n]
            if u in out:
                continue
            total += self.unit_bytes(u)
            if self.max_bytes is not None and total > self.max_bytes:
                break
            out.append(u)
        return out

    def next_pass(self) -> list[int]:
        """The units of `window()` that the next pass uses first: those the window reaches only past the end of
        the order (all of it once a pass has ended, none while the cursor is more than a window from the end)."""
        n = len(self.order)
        if self._recording is not None or self._stale or not n:
            return []
        left = (n - self.pos) % n  # acquisitions to the end of this pass (0: the next pass is about to begin)
        window = self.window()
        seen: set[int] = set()
        out: list[int] = []
        for k in range(n):
            u = self.order[(self.pos + k) % n]
            if u not in window or u in seen:
                continue
            seen.add(u)
            if k >= left:
                out.append(u)
            if len(seen) == len(window):
                break
        return out

    def read_ahead(self, room: int | None = None) -> list[int]:
        """The next units after the cursor that are not resident: what must be read next. Resident units in
        the window take window places but need no reading, so this looks past them. With `room` (bytes free
        for units read in, see [Note: resident units]) as many as fit in it, else the next `depth`."""
        out: list[int] = []
        n = len(self.order)
        total = 0
        for k in range(n):
            if room is None and len(out) >= self.depth:
                break
            u = self.order[(self.pos + k) % n]
            if u in self.resident or u in out:
                continue
            total += self.unit_bytes(u) + self.follow.get(u, 0)
            if room is not None and total > room:
                break
            out.append(u)
        return out

    def on_pass_end(self) -> list[int]:
        """A pass (one top-level forward) ended: finish a recording, rewind to the order's start, and
        return the window that the next pass begins with."""
        self.misses_this_pass = 0
        if self._stale:
            self._stale, self._recording = False, []
            return []
        if self._recording is not None:
            if not self._recording:
                return []
            self.order, self._recording = self._recording, None
        if not self.order:
            return []
        self.pos = 0
        return self.window()

    def _find(self, unit: int) -> int | None:
        n = len(self.order)
        for k in range(1, n + 1):
            i = (self.pos + k) % n
            if self.order[i] == unit:
                return i
        return None


def plan_resident(sizes: dict[int, int], budget: int, depth: int,
                  follow: dict[int, int] | None = None) -> tuple[set[int], int]:
    """Choose units to keep in host memory from one pass to the next, and the prefetch depth left.

    # [Note: resident units]
    Without a plan, every unit is read once per pass whenever the model is larger than the budget: the
    unit needed furthest ahead is evicted first, and in a model read in order that is each unit in turn.
    A unit kept resident costs its bytes of budget once and saves its bytes of reading on every pass, so
    the largest units are kept first (a GPT-2 medium's 206 MB tied embedding saves 15% of the bytes per
    pass). What is left must still hold the unit computing plus one read ahead of the largest unit not
    kept, and the window shrinks to what is left (at least 1, at most `depth`). Kept units are evicted
    only when nothing else can be, so a plan never turns into a budget error.

    What a unit needs while it computes is its own bytes (none when kept) and the bytes read with it: the
    `follow` bytes, its layers' KV blocks on NVMe in generation (see [Note: tiered KV cache]). They are read
    on every pass whatever is kept, so they count in the room to stream and not as savings. Without them,
    generation at a large batch kept GPT-2 medium's embedding under 320 MiB and left room for one layer and
    its blocks at a time: reads and compute took turns, and each decoding step took about a sixth longer than
    with nothing kept. The runtime plans again whenever those bytes change (a block filled), and when the
    partial blocks kept in host memory or the blocks homed there do (they take budget the plan counted as
    free).

    Reads go by the bytes left, not by the window: the runtime reads ahead as many units as fit beside the
    streamed units computing (`Schedule.read_ahead(room)`). The kept units often come first in a pass (a
    GPT-2's embeddings), and while they compute nothing streamed is held, so the disk reads the next two
    or three units then instead of one and does not idle at the start of every pass.

    `sizes` maps unit index to bytes, for units that rest on NVMe, and `follow` unit index to the bytes read
    with it; returns (kept units, depth).
    """
    follow = follow or {}
    users = sizes.keys() | follow.keys()

    def largest_need(kept: set[int]) -> int:
        return max(((0 if v in kept else sizes.get(v, 0)) + follow.get(v, 0) for v in users), default=0)

    resident: set[int] = set()
    kept = 0
    for u in sorted(sizes, key=lambda v: (-sizes[v], v)):
        if kept + sizes[u] + 2 * largest_need(resident | {u}) <= budget:
            resident.add(u)
            kept += sizes[u]
    if not resident:
        return resident, depth
    rest = largest_need(resident)
    if rest == 0:
        return resident, depth
    return resident, max(1, min(depth, (budget - kept) // rest - 1))
