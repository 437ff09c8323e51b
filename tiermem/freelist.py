"""FreeList: sorted free ranges of a fixed or growing space; first-fit (or top-fit) allocation, merging frees.

Shared by the host buffer pool (bytes of one mmap) and the swap store (bytes of the striped swap space).
Callers hold their own lock. `plan_moves` says which pieces to move where so that one range of a given size
becomes free (the host pool's compaction: [Note: host pool compaction] in tiermem/swap/host_cache.py).
"""

from __future__ import annotations

import bisect


class FreeList:
    """Free (start, size) ranges, sorted and never adjacent (neighbours are merged on free)."""

    def __init__(self, size: int = 0) -> None:
        self.holes: list[tuple[int, int]] = [(0, size)] if size else []

    def take(self, size: int, *, from_top: bool = False) -> int | None:
        """Start of a free range of `size` bytes (lowest first, or highest with `from_top`), or None."""
        order = range(len(self.holes) - 1, -1, -1) if from_top else range(len(self.holes))
        for i in order:
            start, hole = self.holes[i]
            if hole < size:
                continue
            if hole == size:
                del self.holes[i]
                return start
            if from_top:
                self.holes[i] = (start, hole - size)
                return start + hole - size
            self.holes[i] = (start + size, hole - size)
            return start
        return None

    def take_at(self, start: int, size: int) -> bool:
        """Take the free range [start, start + size) if it is all free; whether it was."""
        i = bisect.bisect_right(self.holes, (start, float("inf"))) - 1
        if i < 0:
            return False
        hole_start, hole = self.holes[i]
        if start + size > hole_start + hole:
            return False
        rest = [(hole_start, start - hole_start), (start + size, hole_start + hole - start - size)]
        self.holes[i : i + 1] = [(s, n) for s, n in rest if n]
        return True

    def give(self, start: int, size: int) -> None:
        """Return a range, merging it with free neighbours."""
        i = bisect.bisect_left(self.holes, (start, 0))
        self.holes.insert(i, (start, size))
        if i + 1 < len(self.holes) and start + size == self.holes[i + 1][0]:
            self.holes[i] = (start, size + self.holes[i + 1][1])
            del self.holes[i + 1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == self.holes[i][0]:
            self.holes[i - 1] = (self.holes[i - 1][0], self.holes[i - 1][1] + self.holes[i][1])
            del self.holes[i]

    def largest(self) -> int:
        return max((h for _, h in self.holes), default=0)


def plan_moves(holes: list[tuple[int, int]], movable: list[tuple[int, int]], size: int,
               tries: int = 64) -> list[tuple[int, int]] | None:
    """Moves that free one range of `size` bytes: (from, to) starts of pieces in `movable`, or None.

    `holes` are the free (start, size) ranges and `movable` the (start, size) pieces that may move; every
    other byte is held in place. The range is a run of holes and movable pieces side by side; the pieces
    in it go to holes outside it, the largest first, each into the smallest that takes it. Of the runs, the
    one that moves the fewest bytes and can be placed wins; `tries` bounds how many are tried.
    """
    items = sorted([(s, n, False) for s, n in holes if n] + [(s, n, True) for s, n in movable])
    candidates: list[tuple[int, int, list[tuple[int, int]]]] = []  # (bytes moved, window start, pieces)
    for i, (start, _, _) in enumerate(items):
        end, j, pieces = start, i, []
        while end - start < size and j < len(items) and items[j][0] == end:  # side by side, nothing held between
            s, n, moves = items[j]
            if moves:
                pieces.append((s, n))
            end, j = s + n, j + 1
        if end - start >= size:
            candidates.append((sum(n for _, n in pieces), start, pieces))
    for _, start, pieces in sorted(candidates)[:tries]:
        stop = start + size
        outside = [(s, n) for s, n in holes if s + n <= start or s >= stop]  # whole holes outside the window
        outside += [(max(s, stop), s + n - max(s, stop)) for s, n in holes if s < stop < s + n]  # its tail
        plan = []
        for s, n in sorted(pieces, key=lambda p: -p[1]):
            fits = [k for k, (_, h) in enumerate(outside) if h >= n]
            if not fits:
                break
            k = min(fits, key=lambda k: outside[k][1])
            dest, h = outside[k]
            outside[k] = (dest + n, h - n)
            plan.append((s, dest))
        else:
            return plan
    return None
