"""FreeList: sorted free ranges of a fixed or growing space; first-fit (or top-fit) allocation, merging frees.

Shared by the host buffer pool (bytes of one mmap) and the swap store (bytes of the striped swap space).
Callers hold their own lock.
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
