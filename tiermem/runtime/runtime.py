"""The runtime behind `tiered_offload`: units, the schedule, and the forward hooks that drive them.

# [Note: acquire and release]
A forward pre-hook on each hooked module acquires the units that module needs (its own, plus the
units of tied parameters it holds), binding their parameters to partition views on the device; the
matching forward hook (always called, also when forward raises) releases them. Acquiring asks the
schedule for the window of units needed next and prefetches them; releasing keeps a unit on the
device when the window holds it again. See [Note: prefetch window] in schedule.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from tiermem.runtime.schedule import Schedule
from tiermem.runtime.unit import Unit
from tiermem.swap import Residency, TensorSwapper

log = logging.getLogger(__name__)


class Runtime:
    """Owns the units and the schedule of one `tiered_offload` context; registers and removes hooks."""

    def __init__(self, model: nn.Module, swapper: TensorSwapper, units: list[Unit],
                 needs: dict[nn.Module, list[int]], *, prefetch: bool = True) -> None:
        self.model = model
        self.swapper = swapper
        self.units = units
        self.needs = needs  # module -> indices of the units its forward needs
        cfg = swapper.config.prefetch
        self.prefetch_enabled = prefetch and cfg.depth > 0
        self.schedule = Schedule(cfg.depth if self.prefetch_enabled else 0, cfg.max_bytes,
                                 lambda i: units[i].nbytes)
        self.handles: list[RemovableHandle] = []  # every hook we registered, removed on exit
        self._pass_depth = 0  # nesting of the model's own forward; a pass ends when it returns to 0
        self._on_device: set[int] = set()  # units whose partition is on the device (in use or kept)
        self.stall_seconds = 0.0  # time forward waited for a unit's bytes
        self.prefetch_hits = 0  # acquisitions whose bytes were on the device or on their way
        self.prefetch_misses = 0  # acquisitions that had to start reading
        self.passes = 0
        self._unit_of = {id(u.partition): u.index for u in units}
        self._distance: tuple[int, dict[int, int]] = (-1, {})  # (cursor, unit -> acquisitions until next use)
        swapper.next_use = self._next_use

    def _next_use(self, part: object) -> float:
        """Acquisitions until the schedule needs this partition again (inf when it never does)."""
        order = self.schedule.order
        if not order:
            return 0.0  # nothing recorded yet: fall back to least recently used
        pos, dist = self._distance
        if pos != self.schedule.pos or not dist:
            n = len(order)
            dist = {}
            for k in range(n):
                dist.setdefault(order[(self.schedule.pos + k) % n], k)
            self._distance = (self.schedule.pos, dist)
        return float(dist.get(self._unit_of.get(id(part), -1), float("inf")))

    # -- hooks --------------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        """All hooks, in one place; their handles are kept so `remove_hooks` undoes exactly these."""
        self.handles.append(self.model.register_forward_pre_hook(self._pass_begin))
        self.handles.append(self.model.register_forward_hook(self._pass_end, always_call=True))
        for module, indices in self.needs.items():
            self.handles.append(module.register_forward_pre_hook(self._make_pre(indices)))
            self.handles.append(module.register_forward_hook(self._make_post(indices), always_call=True))

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _make_pre(self, indices: list[int]) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            for i in indices:
                self.enter(i)

        return pre

    def _make_post(self, indices: list[int]) -> Any:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            for i in reversed(indices):
                self.exit(i)

        return post

    def _pass_begin(self, module: nn.Module, args: Any) -> None:
        self._pass_depth += 1

    def _pass_end(self, module: nn.Module, args: Any, output: Any) -> None:
        self._pass_depth -= 1
        if self._pass_depth == 0:
            self.passes += 1
            window = self.schedule.on_pass_end()
            self._prefetch(window)

    # -- acquire / release --------------------------------------------------------------------------
    def enter(self, i: int) -> None:
        """Make unit `i` usable on the device (see [Note: acquire and release])."""
        unit = self.units[i]
        unit.depth += 1
        if unit.depth > 1:
            return
        part = unit.partition
        ready = part.state in (Residency.DEVICE, Residency.TO_DEVICE, Residency.READING) or (
            part.state is Residency.HOST and not self.swapper.mover.copies)
        if ready:
            self.prefetch_hits += 1
        else:
            self.prefetch_misses += 1
        window = self.schedule.on_acquire(i)
        t0 = time.perf_counter()
        try:
            # this unit's read is queued first; the window's reads start once it is marked in use
            tensors = self.swapper.acquire(part, "device", before_wait=lambda: self._prefetch(window))
        except BaseException:
            unit.depth -= 1
            raise
        self.stall_seconds += time.perf_counter() - t0
        self._on_device.add(i)
        unit.bind(tensors)
        for j in list(self._on_device):  # units left on the device that nothing will need soon
            if j != i and self.units[j].depth == 0 and j not in window:
                self.swapper.demote(self.units[j].partition)
                self._on_device.discard(j)

    def exit(self, i: int, *, dirty: bool = False) -> None:
        """Release unit `i`, keeping it on the device if the window needs it again."""
        unit = self.units[i]
        unit.depth -= 1
        if unit.depth > 0:
            return
        unit.unbind()
        keep = i in self.schedule.window() if self.schedule.order else False
        self.swapper.release(unit.partition, keep=keep, dirty=dirty)
        if not keep:
            self._on_device.discard(i)

    def _prefetch(self, window: list[int]) -> None:
        for j in window:
            part = self.units[j].partition
            if part.state is not Residency.DEVICE:
                self.swapper.prefetch(part, "device")
            self._on_device.add(j)

    def reset_stats(self) -> None:
        self.stall_seconds = 0.0
        self.prefetch_hits = self.prefetch_misses = self.passes = 0
        self.schedule.hits = self.schedule.misses = self.schedule.retraces = 0

    def gather(self, indices: list[int]) -> None:
        """Acquire units outside any forward (for `OffloadHandle.gathered`)."""
        for i in indices:
            self.enter(i)

    def scatter(self, indices: list[int], *, dirty: bool = False) -> None:
        for i in reversed(indices):
            self.exit(i, dirty=dirty)


def unit_for_each_param(units: list[Unit]) -> dict[int, int]:
    """id(Parameter) -> unit index."""
    return {id(p): u.index for u in units for _, p in u.params}

