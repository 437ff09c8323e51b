"""Byte accounting per tier, now and at peak, with the budgets that bound it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tiermem.errors import BudgetError
from tiermem.sizes import format_size

TIERS = ("device", "host", "nvme")


@dataclass(frozen=True)
class LedgerSnapshot:
    """Bytes per tier at one moment (`now`) and the most since the last reset (`peak`)."""

    now: dict[str, int]
    peak: dict[str, int]


class Ledger:
    """Counts bytes held per tier. A charge past a tier's budget raises BudgetError and is not made: callers
    make room first, so it reaches the user only when no room can be made."""

    def __init__(self, *, host_budget: int | None = None, device_budget: int | None = None) -> None:
        self._lock = threading.Lock()
        # the most each tier may hold (None: no limit); the device's is memory.device_budget only, not a cap
        # the runtime derives (see [Note: device budget] in swapper.py)
        self.budget: dict[str, int | None] = {"device": device_budget, "host": host_budget, "nvme": None}
        self._now = dict.fromkeys(TIERS, 0)  # bytes held now
        self._peak = dict.fromkeys(TIERS, 0)  # most bytes held since the last reset
        self._by_arena: dict[str, int] = {}  # host bytes held now, by the arena the partitions asked for

    def add(self, tier: str, nbytes: int, what: str = "", *, arena: str | None = None) -> None:
        """Charge `nbytes` to `tier` (and, on the host, to `arena`); BudgetError naming `what` when that
        passes the tier's budget."""
        with self._lock:
            total = self._now[tier] + nbytes
            limit = self.budget[tier]
            if limit is not None and total > limit:
                raise BudgetError(f"{what}: {tier} would hold {format_size(total)}, over its budget of "
                                  f"{format_size(limit)}")
            self._now[tier] = total
            self._peak[tier] = max(self._peak[tier], total)
            if arena is not None:
                self._by_arena[arena] = self._by_arena.get(arena, 0) + nbytes

    def sub(self, tier: str, nbytes: int, *, arena: str | None = None) -> None:
        """Take back a charge made by `add` (with the same `arena`)."""
        with self._lock:
            self._now[tier] -= nbytes
            if self._now[tier] < 0:
                raise AssertionError(f"ledger for {tier} went negative")
            if arena is not None:
                self._by_arena[arena] -= nbytes
                if self._by_arena[arena] < 0:
                    raise AssertionError(f"ledger for host arena {arena} went negative")

    def now(self, tier: str) -> int:
        """Bytes `tier` holds now."""
        return self._now[tier]

    def host_in(self, arena: str) -> int:
        """Host bytes held now by partitions of `arena` (wherever their buffers are: a saved activation that
        overflows into the main arena still counts as the activations'), in O(1)."""
        return self._by_arena.get(arena, 0)

    def snapshot(self) -> LedgerSnapshot:
        """Bytes per tier now and at peak, copied under the lock."""
        with self._lock:
            return LedgerSnapshot(dict(self._now), dict(self._peak))

    def reset_peaks(self) -> None:
        """Start a new measuring window: peaks restart from what is held now."""
        with self._lock:
            self._peak = dict(self._now)
