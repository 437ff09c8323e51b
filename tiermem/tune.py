"""`tiermem tune`: the I/O settings that move bytes fastest on given swap directories, then the prefetch depth
and host-budget split for a model, written as a swap-config.

# [Note: tuning]
The I/O search measures settings (engine x block size x queue depth, x SQPOLL where io_uring takes it) with
`tiermem bench io`'s own benchmark (tiermem/io/bandwidth.py): one setting is one write and one read of
`size` bytes through a swap store on the directories (striped when several), scored by the harmonic mean
of its read and write GB/s, the rate at which a step that reads and writes equal bytes moves them. It goes
coarse to fine under a time limit:
1. coarse: every other block size and queue depth of the grid (both ends kept), for each engine variant;
2. fine: the unmeasured neighbours (one step along either axis, or both) of the two best so far, in their
   engine variant, again until the best two have none left;
3. confirm: the best three measured once more, three rounds (the best three of each round: a setting
   whose first run was lucky drops out as its mean falls), so that one lucky run does not decide.
Before each measurement it checks that the longest one so far still fits in what is left of the limit;
the first is always taken. The pick is the best mean score of what was measured. On a grid whose scores
rise to one peak along each axis the fine steps reach that peak; elsewhere the pick is the best of the
points measured, which the ranked table shows.

With a model, every prefetch.depth from 1 to 4, and, when activations go to NVMe, activations.buffer at
1/16, 1/8 and 1/4 of memory.host_budget, is planned with `tiermem.plan` (nothing runs); of the plans that
fit, the one with the lowest step-time bound wins, a deeper window on a tie (it hides more latency, which
the bound does not see), then a smaller activations buffer. The bound divides each step's NVMe bytes by
the figures just measured, which `tune` caches as `tiermem bench io` does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiermem.errors import TiermemError
from tiermem.io.backends import available_backends
from tiermem.io.bandwidth import BenchSpec, run_benchmark, save_bench_results

log = logging.getLogger(__name__)

BLOCK_SIZES = [128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]
QUEUE_DEPTHS = [1, 2, 4, 8, 16, 32, 64, 128]
DEPTHS = (1, 2, 3, 4)  # prefetch.depth candidates
ACTIVATION_SHARES = (16, 8, 4)  # activations.buffer = memory.host_budget / share


@dataclass(frozen=True)
class Setting:
    """One point of the I/O grid."""

    engine: str
    block_size: int
    queue_depth: int
    sqpoll: bool = False

    @property
    def variant(self) -> tuple[str, bool]:
        return self.engine, self.sqpoll

    def to_config(self) -> dict[str, Any]:
        """The io.* keys of this setting."""
        return {"io.engine": self.engine, "io.block_size": self.block_size, "io.queue_depth": self.queue_depth,
                "io.sqpoll": self.sqpoll}


@dataclass
class Measured:
    """A setting's runs: GB/s of each write and read."""

    setting: Setting
    read: list[float] = field(default_factory=list)
    write: list[float] = field(default_factory=list)
    seconds: float = 0.0  # the time its measurements took, all runs

    @property
    def read_gbps(self) -> float:
        return sum(self.read) / len(self.read) if self.read else 0.0

    @property
    def write_gbps(self) -> float:
        return sum(self.write) / len(self.write) if self.write else 0.0

    @property
    def score(self) -> float:
        """Harmonic mean of the mean read and write GB/s: equal bytes each way move at this rate."""
        r, w = self.read_gbps, self.write_gbps
        return 2 * r * w / (r + w) if r > 0 and w > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        s = self.setting
        return {"engine": s.engine, "block_size": s.block_size, "queue_depth": s.queue_depth, "sqpoll": s.sqpoll,
                "read_gbps": self.read_gbps, "write_gbps": self.write_gbps, "score_gbps": self.score,
                "runs": len(self.read), "read_samples": list(self.read), "write_samples": list(self.write)}


Measure = Callable[[Setting], tuple[float, float]]  # a setting -> (read GB/s, write GB/s) of one run
Progress = Callable[[int, int, str], None]


def engine_variants(engines: Sequence[str] | None = None, sqpoll: bool | None = None) -> list[tuple[str, bool]]:
    """The (engine, sqpoll) pairs to search: the usable engines (or `engines`), io_uring with and without
    SQPOLL where a ring with SQPOLL opens here (`sqpoll` None), only with (True) or only without (False)."""
    usable = [n for n, why in available_backends().items() if why is None]
    chosen = [e for e in (engines or usable) if e in usable]
    out: list[tuple[str, bool]] = []
    for engine in chosen:
        if engine == "io_uring" and sqpoll is not False and _sqpoll_works():
            out.append((engine, True))
        if engine != "io_uring" or sqpoll is not True:
            out.append((engine, False))
    return out


def _sqpoll_works() -> bool:
    from tiermem.io.backends import create_engine

    try:
        create_engine("io_uring", block_size=4096, queue_depth=1, sqpoll=True).close()
    except (OSError, TiermemError) as exc:  # no SQPOLL here (privileges, an old kernel)
        log.info("io_uring SQPOLL is not usable here (%s); tuned without it", exc)
        return False
    return True


def search(variants: Sequence[tuple[str, bool]], block_sizes: Sequence[int], queue_depths: Sequence[int],
           measure: Measure, *, time_limit: float, clock: Callable[[], float] = time.monotonic,
           progress: Progress | None = None, confirm: int = 3, rounds: int = 3) -> list[Measured]:
    """Search the grid coarse to fine within `time_limit` seconds (see [Note: tuning]); every setting
    measured, the best first."""
    bss, qds = sorted(block_sizes), sorted(queue_depths)
    start = clock()
    done: dict[Setting, Measured] = {}
    longest = 0.0  # the longest measurement so far: what the next one is expected to take at most
    planned = 0

    def fits() -> bool:
        return not done or clock() - start + longest <= time_limit

    def take(setting: Setting) -> bool:
        nonlocal longest
        if not fits():
            return False
        t0 = clock()
        read, write = measure(setting)
        elapsed = clock() - t0
        got = done.setdefault(setting, Measured(setting))
        got.read.append(read)
        got.write.append(write)
        got.seconds += elapsed
        longest = max(longest, elapsed)
        if progress is not None:
            progress(sum(len(m.read) for m in done.values()), max(planned, len(done)),
                     f"{setting.engine}{' sqpoll' if setting.sqpoll else ''} bs={setting.block_size >> 10}KiB "
                     f"qd={setting.queue_depth}")
        return True

    def ranked() -> list[Measured]:
        return sorted(done.values(), key=lambda m: -m.score)

    coarse = [Setting(e, bss[i], qds[j], sq) for e, sq in variants for i in _coarse(len(bss))
              for j in _coarse(len(qds))]
    planned = len(coarse) + confirm * rounds
    for setting in coarse:
        if not take(setting):
            return ranked()
    while True:  # fine: the neighbours of the best two
        todo = [n for m in ranked()[:2] for n in _neighbours(m.setting, bss, qds) if n not in done]
        todo = list(dict.fromkeys(todo))
        if not todo:
            break
        planned += len(todo)
        for setting in todo:
            if not take(setting):
                return ranked()
    for _ in range(rounds):  # confirm: the best few again, so that one lucky run does not decide
        for m in ranked()[:confirm]:
            if not take(m.setting):
                return ranked()
    return ranked()


def _coarse(n: int) -> list[int]:
    return sorted({*range(0, n, 2), n - 1}) if n else []


def _neighbours(s: Setting, bss: list[int], qds: list[int]) -> list[Setting]:
    i, j = bss.index(s.block_size), qds.index(s.queue_depth)
    out = []
    for di in (-1, 0, 1):
        for dj in (-1, 0, 1):
            if (di or dj) and 0 <= i + di < len(bss) and 0 <= j + dj < len(qds):
                out.append(Setting(s.engine, bss[i + di], qds[j + dj], s.sqpoll))
    return out


def bench_measure(paths: list[str], size: int, *, direct: bool = True,
                  results: list[dict[str, Any]] | None = None) -> Measure:
    """A Measure that runs `tiermem bench io`'s benchmark once per call (a write, then a read, of `size`);
    each result row is appended to `results` when given (to cache them as bench io does)."""

    def measure(setting: Setting) -> tuple[float, float]:
        rows = run_benchmark(BenchSpec(paths=paths, size=size, block_sizes=[setting.block_size],
                                       queue_depths=[setting.queue_depth], engines=[setting.engine],
                                       modes=["write", "read"], runs=1, direct=direct, sqpoll=setting.sqpoll))
        if results is not None:
            results.extend(rows)
        gbps = {r["mode"]: r["gbps_mean"] for r in rows}
        return gbps["read"], gbps["write"]

    return measure


@dataclass
class ModelChoice:
    """What `choose_for_model` picked, and every plan it weighed."""

    overrides: dict[str, Any]  # prefetch.depth (and activations.buffer) to set
    step_seconds_min: float | None
    candidates: list[dict[str, Any]]  # one per plan: its keys, fits, the bound


def choose_for_model(model: Any, config: Any, base: dict[str, Any], *, optimizer: str | None = None,
                     batch: Any = None,
                     time_limit: float = 60.0, clock: Callable[[], float] = time.monotonic,
                     plan_fn: Callable[..., Any] | None = None) -> ModelChoice:
    """prefetch.depth and the host budget's split for `model` under `config` (what `tiermem.plan` takes) with
    dotted overrides `base`, judged by
    `tiermem.plan`'s step-time bound (see [Note: tuning]); plans that do not fit are never chosen (when none
    fits, the one with the fewest fixes, to be told what to change)."""
    if plan_fn is None:
        from tiermem.planning import plan

        plan_fn = plan
    start = clock()
    first = plan_fn(model, config, optimizer=optimizer, batch=batch, **base)
    splits: list[int | None] = [None]
    if first.config.activations.tier == "nvme":
        budget = first.config.memory.host_budget
        splits = [budget // share // 4096 * 4096 for share in ACTIVATION_SHARES]
    candidates: list[dict[str, Any]] = []
    for depth in DEPTHS:
        for buffer in splits:
            if candidates and clock() - start > time_limit:
                break
            keys: dict[str, Any] = {"prefetch.depth": depth}
            if buffer is not None:
                keys["activations.buffer"] = buffer
            p = plan_fn(model, config, optimizer=optimizer, batch=batch, **{**base, **keys})
            candidates.append({"keys": keys, "fits": p.fits, "fixes": len(p.fixes),
                               "step_seconds_min": p.step_seconds_min, "step_note": p.step_note})

    def order(c: dict[str, Any]) -> tuple[Any, ...]:
        bound = c["step_seconds_min"]
        return (not c["fits"], c["fixes"], bound is None, bound if bound is not None else 0.0,
                -c["keys"]["prefetch.depth"], c["keys"].get("activations.buffer", 0))

    best = min(candidates, key=order)
    return ModelChoice(dict(best["keys"]), best["step_seconds_min"], candidates)


def cache_results(paths: list[str], results: list[dict[str, Any]]) -> str | None:
    """Cache what the search measured as `tiermem bench io` does (see [Note: bench cache])."""
    return save_bench_results(paths, results) if results else None
