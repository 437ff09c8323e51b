#!/usr/bin/env python3
"""The optimizer's arithmetic alone: one update of GPT-2 small's parameters (124M, fp32), three ways, in one
process, alternating, for each optimizer setting.

- torch: the optimizer in memory, stepping the model's 148 parameters one by one (what plain PyTorch runs).
- tiermem: what `TieredOptimizer` runs for each unit (12 blocks of 7.1M elements, the embeddings' 39.4M),
  its real `_apply`: the user's optimizer class on the unit's flat range, in pieces of `_CHUNK` elements
  (tiermem/optim/optimizer.py, [Note: which optimizers]).
- whole: the same on each flat range in one call, as the update ran before the pieces: its temporaries are
  as large as the range.

No I/O and no model: the gradients are random, the state starts from one step taken before timing. tiermem
and whole run under tiermem's CPU allocator, as inside a context; torch under PyTorch's. Reported: median
ms per update over --reps, and tiermem's ratio to torch.

    python3 bench/optimizer_update.py --json bench/results/optimizer_update.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import describe_system, package_versions, print_system_header, write_json  # noqa: E402

import tiermem.optim.optimizer as tiered  # noqa: E402
from tiermem.cpu_allocator import cpu_allocator  # noqa: E402

HIDDEN, LAYERS, VOCAB, POSITIONS = 768, 12, 50257, 1024
SETTINGS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01),
    "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True),
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-4),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-4),
}


def gpt2_small_shapes() -> list[list[tuple[int, ...]]]:
    """Each unit's parameter shapes: the embeddings (with ln_f), then 12 blocks."""
    h = HIDDEN
    block = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)]
    return [[(VOCAB, h), (POSITIONS, h), (h,), (h,)]] + [block] * LAYERS


class Units:
    """Flat fp32 ranges per unit, as the partitions hold them: parameters, gradients and each state kind."""

    def __init__(self, make: Callable[[Any], torch.optim.Optimizer], shapes: list[list[tuple[int, ...]]]) -> None:
        gen = torch.Generator().manual_seed(0)
        self.kind = type(make([torch.zeros(1)]))
        group = make([torch.zeros(1)]).param_groups[0]
        self.group = {k: v for k, v in group.items() if k != "params"}
        kinds = tiered._state_of(self.kind, group)[0]
        self.ranges = []
        for unit in shapes:
            n = sum(torch.Size(s).numel() for s in unit)
            p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
            state = {k: torch.zeros(n) for k in kinds}
            self.ranges.append((p, g, state))
        self.optimizer = tiered.TieredOptimizer.__new__(tiered.TieredOptimizer)  # only `_apply` is used
        self.optimizer.__dict__["kind"] = self.kind
        self.scalars: list[dict[str, torch.Tensor] | None] = [None] * len(self.ranges)  # None: no step yet

    def update(self) -> None:
        for i, (p, g, state) in enumerate(self.ranges):
            self.scalars[i] = self.optimizer._apply(self.group, p, g, state, self.scalars[i])


class InMemory:
    """The model's parameters as separate tensors and the optimizer on them, as plain PyTorch holds them."""

    def __init__(self, make: Callable[[Any], torch.optim.Optimizer], shapes: list[list[tuple[int, ...]]]) -> None:
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for unit in shapes for s in unit]
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        self.opt = make(self.params)

    def update(self) -> None:
        self.opt.step()


def whole_ranges(units: Units) -> None:
    """`units.update()` with each range in one piece."""
    chunk = tiered._CHUNK
    tiered._CHUNK = 1 << 62
    try:
        units.update()
    finally:
        tiered._CHUNK = chunk


def time_it(fn: Callable[[], None], allocator: str | None) -> float:
    with cpu_allocator(allocator) if allocator else nullcontext():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7, help="timed updates per way and setting (default 7)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {unknown}; choose from {', '.join(SETTINGS)}")
    system = describe_system([os.getcwd()])
    print_system_header("optimizer update, GPT-2 small's parameters", system, package_versions("torch"))
    print(f"  torch threads {torch.get_num_threads()}; pieces of {tiered._CHUNK} elements; {args.reps} reps")
    shapes = gpt2_small_shapes()
    results: dict[str, Any] = {}
    for name in names:
        make = SETTINGS[name]
        memory, units = InMemory(make, shapes), Units(make, shapes)
        ways: dict[str, tuple[Callable[[], None], str | None]] = {
            "torch": (memory.update, None), "tiermem": (units.update, "auto"),
            "whole": (lambda u=units: whole_ranges(u), "auto")}
        for fn, allocator in ways.values():  # the first step makes the state; not timed
            time_it(fn, allocator)
        times: dict[str, list[float]] = {w: [] for w in ways}
        for rep in range(args.reps):
            order = list(ways)[rep % 3:] + list(ways)[:rep % 3]
            for way in order:
                fn, allocator = ways[way]
                times[way].append(time_it(fn, allocator))
        med = {w: statistics.median(ts) for w, ts in times.items()}
        results[name] = {"median_s": med, "all_s": times, "tiermem_over_torch": med["tiermem"] / med["torch"],
                         "whole_over_tiermem": med["whole"] / med["tiermem"]}
        print(f"{name:14} torch {med['torch'] * 1e3:7.1f} ms  tiermem {med['tiermem'] * 1e3:7.1f} ms  "
              f"whole ranges {med['whole'] * 1e3:7.1f} ms  |  tiermem/torch {med['tiermem'] / med['torch']:.2f}  "
              f"whole/tiermem {med['whole'] / med['tiermem']:.2f}", flush=True)
    if args.json:
        write_json(args.json, {"system": system, "chunk_elements": tiered._CHUNK, "reps": args.reps,
                               "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
