"""The I/O bandwidth benchmark behind `tiermem bench io`: sequential reads and writes through the engines.

Each measurement writes or reads `size` bytes of one swap extent (striped across every path) in
requests of `block_size`, keeping `queue_depth` requests in flight, from a pool of queue_depth
aligned blocks (no more host memory than that). The benchmark hands the engine transfers of a quarter
of the pool (TRANSFERS_IN_FLIGHT of them at a time), which the engine splits into block-size requests,
as it does for the swapper's partition-sized transfers; the kernel sees the same requests either way.
Reads go around the page cache: with O_DIRECT, or, where a filesystem refuses it, after dropping the
file's pages with posix_fadvise(DONTNEED), which the result records as `direct: false` and
`cache: "dropped"`.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiermem.io.backends import available_backends, create_engine
from tiermem.io.buffers import HostBufferPool, PoolBuffer
from tiermem.io.files import fs_of
from tiermem.io.future import IOFuture
from tiermem.store import Extent, SwapStore

log = logging.getLogger(__name__)

GB = 1e9
GIB = 1 << 30
TRANSFERS_IN_FLIGHT = 4  # the engine gets transfers of queue_depth / 4 blocks

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, label)


@dataclass
class BenchSpec:
    """What to measure; every combination of engines x modes x block_sizes x queue_depths."""

    paths: list[str]
    size: int
    block_sizes: list[int]
    queue_depths: list[int]
    engines: list[str]
    modes: list[str] = field(default_factory=lambda: ["write", "read"])
    runs: int = 3
    direct: bool = True
    stripe_size: int | None = None  # default: the block size, so each request maps to one drive
    weights: tuple[int, ...] | None = None  # stripe chunks per path in a period ([Note: striping]); None: equal
    sqpoll: bool = False  # io_uring engines poll their submission queue from a kernel thread (io.sqpoll)


def system_info(paths: list[str]) -> dict[str, Any]:
    """Kernel, filesystem, device and engine availability for the benchmark header."""
    devices = [block_device_of(p) for p in paths]
    return {
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "paths": [
            {"path": p, "filesystem": fs_of(p), "device": d, "model": _device_model(d), "rotational": _rotational(d)}
            for p, d in zip(paths, devices, strict=True)
        ],
        "transparent_hugepage": _read_first("/sys/kernel/mm/transparent_hugepage/enabled"),
        "engines": {name: (reason or "available") for name, reason in available_backends().items()},
    }


def run_benchmark(spec: BenchSpec, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Measure every combination in `spec`; return one result dict per (engine, mode, block, depth)."""
    results = []
    combos = [(e, bs, qd) for e in spec.engines for bs in spec.block_sizes for qd in spec.queue_depths]
    total = len(combos) * spec.runs * spec.size * (len(spec.modes) + (1 if "write" not in spec.modes else 0))
    done = 0

    tick_lock = threading.Lock()  # completions tick from the engines' threads, several at once (threads)

    def tick(n: int, label: str) -> None:
        nonlocal done
        with tick_lock:
            done += n
            if progress:
                progress(done, total, label)

    for engine_name, bs, qd in combos:
        with create_engine(engine_name, block_size=bs, queue_depth=qd,
                           sqpoll=spec.sqpoll and engine_name == "io_uring") as engine, \
                SwapStore(spec.paths, engine, stripe_size=spec.stripe_size or bs, weights=spec.weights,
                          direct=spec.direct) as store, \
                HostBufferPool(bs * qd, prefault=True) as pool:
            engine.register_buffers(pool.regions)
            per = transfer_size(bs, qd)
            slots = [pool.alloc(per) for _ in range(bs * qd // per)]
            for i, s in enumerate(slots):
                s.numpy()[:] = (i * 37 + 11) & 0xFF  # not zeros: some devices shortcut zero pages
            extent = store.allocate(spec.size)
            devices = sorted({d for d in (block_device_of(p) for p in spec.paths) if d})
            if "write" not in spec.modes:  # reads need data there first; not timed
                _stream(store, extent, slots, spec.size, per, write=True, tick=lambda n: tick(n, "preparing"))
                store.flush()
            for mode in spec.modes:
                samples, cpu, reqs = [], [], []
                advance = functools.partial(tick, label=f"{engine_name} {mode} bs={bs >> 10}KiB qd={qd}")
                for _ in range(spec.runs):
                    write = mode == "write"
                    if not write and not store.direct:
                        store.flush()
                        _drop_cache(store)
                    before = disk_stats(devices)
                    cpu0, t0 = time.process_time(), time.perf_counter()
                    _stream(store, extent, slots, spec.size, per, write=write, tick=advance)
                    if write and not store.direct:
                        store.flush()  # buffered writes must reach the disk to count
                    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
                    samples.append(spec.size / elapsed / GB)
                    cpu.append(cpu_s / (spec.size / GIB))
                    reqs.append(_avg_request(before, disk_stats(devices), write))
                known = [r for r in reqs if r is not None]
                results.append({
                    "engine": engine_name,
                    "mode": mode,
                    "block_size": bs,
                    "queue_depth": qd,
                    "sqpoll": spec.sqpoll and engine_name == "io_uring",
                    "weights": list(store.layout.weights),
                    "transfer_size": per,
                    "bytes": spec.size,
                    "runs": spec.runs,
                    "gbps_mean": statistics.fmean(samples),
                    "gbps_std": statistics.stdev(samples) if len(samples) > 1 else 0.0,
                    "gbps_samples": samples,
                    "cpu_seconds_per_gib": statistics.fmean(cpu),
                    "direct": store.direct,
                    "cache": "bypassed" if store.direct else "dropped",
                    "avg_request_kib": statistics.fmean(known) if known else None,
                    "paths": len(spec.paths),
                })
    return results


def transfer_size(block_size: int, queue_depth: int) -> int:
    """Bytes per transfer handed to the engine: a whole number of blocks, TRANSFERS_IN_FLIGHT fill the queue."""
    return block_size * max(1, queue_depth // TRANSFERS_IN_FLIGHT)


def _stream(store: SwapStore, extent: Extent, slots: list[PoolBuffer], size: int, per: int, *, write: bool,
            tick: Callable[[int], None]) -> None:
    """Move `size` bytes of the extent in transfers of `per` bytes, one per slot, keeping every slot busy.

    Each completion queues the slot's next transfer from the engine's completion thread, so the caller
    sleeps once instead of waking (and taking the GIL back) for every transfer. That wake-up cost more
    CPU than the engine itself at 1 MiB blocks, and a program that keeps its own thread busy never pays it.
    """
    op = store.write if write else store.read
    offsets = iter(range(0, size, per))
    lock = threading.Lock()
    free = collections.deque(range(len(slots)))  # slots whose transfer has finished
    errors: list[BaseException] = []
    finished = threading.Event()
    state = {"issuing": True, "in_flight": 0}  # issuing: some thread is in issue(); others only hand back

    def done(k: int, fut: IOFuture) -> None:
        try:
            if fut.exception() is None:
                tick(fut.nbytes)
        except BaseException as exc:  # a failing progress callback must not hang the benchmark
            errors.append(exc)
        with lock:
            if fut.exception() is not None:
                errors.append(fut.exception())  # type: ignore[arg-type]
            state["in_flight"] -= 1
            free.append(k)
            if state["issuing"]:
                return
            state["issuing"] = True
        issue()

    def issue() -> None:
        while True:
            with lock:
                offset = next(offsets, None) if free and not errors else None
                if offset is None:
                    state["issuing"] = False
                    if state["in_flight"] == 0:
                        finished.set()
                    return
                k = free.popleft()
                state["in_flight"] += 1
            try:
                fut = op(extent, slots[k].view, min(per, size - offset), offset)
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                    state["in_flight"] -= 1
                continue
            fut.add_done_callback(functools.partial(done, k))

    try:
        issue()
        finished.wait()
    except BaseException as exc:  # interrupted: queue nothing more, let what is in flight land, then go
        with lock:
            errors.append(exc)  # issue() stops at the first error
            idle = state["in_flight"] == 0
        if not idle:
            finished.wait()
        raise
    if errors:
        raise errors[0]


def _drop_cache(store: SwapStore) -> None:
    for f in store.files:
        os.posix_fadvise(f.buffered_fd, 0, 0, os.POSIX_FADV_DONTNEED)


# -- block device statistics ----------------------------------------------------------------------
def block_device_of(path: str) -> str | None:
    """The /proc/diskstats name of the device holding `path` (e.g. 'vda', 'nvme0n1p2'), or None."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)  # a directory not made yet lives on its nearest ancestor's device
    try:
        st = os.stat(path)
        link = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    except OSError:
        return None
    name = os.path.basename(link)
    return name if os.path.exists(link) else None


def disk_stats(devices: list[str]) -> dict[str, tuple[int, int, int, int]]:
    """Per device: (reads completed, sectors read, writes completed, sectors written)."""
    out: dict[str, tuple[int, int, int, int]] = {}
    try:
        with open("/proc/diskstats", encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 10 and parts[2] in devices:
                    out[parts[2]] = (int(parts[3]), int(parts[5]), int(parts[7]), int(parts[9]))
    except OSError:
        pass
    return out


def _avg_request(before: dict[str, tuple[int, int, int, int]], after: dict[str, tuple[int, int, int, int]],
                 write: bool) -> float | None:
    """Mean request size (KiB) that reached the devices between two disk_stats snapshots."""
    ios = sectors = 0
    for dev, a in after.items():
        b = before.get(dev)
        if b is None:
            continue
        i = 2 if write else 0
        ios += a[i] - b[i]
        sectors += a[i + 1] - b[i + 1]
    return sectors * 512 / 1024 / ios if ios > 0 else None



def _sys_block_dir(device: str | None) -> str | None:
    if not device:
        return None
    d = f"/sys/class/block/{device}"
    if os.path.exists(f"{d}/partition"):
        d = os.path.dirname(os.path.realpath(d))
    return d


def _device_model(device: str | None) -> str | None:
    d = _sys_block_dir(device)
    if not d:
        return None
    model = _read_first(f"{d}/device/model")
    if model:
        return model
    driver = os.path.realpath(f"{d}/device/driver") if os.path.exists(f"{d}/device/driver") else ""
    return os.path.basename(driver) or None


def _rotational(device: str | None) -> bool | None:
    d = _sys_block_dir(device)
    value = _read_first(f"{d}/queue/rotational") if d else None
    return None if value is None else value == "1"


def _read_first(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


# -- the cache of results, for `tiermem plan` -----------------------------------------------------
# [Note: bench cache]
# `tiermem bench io` records its best figures in $XDG_CACHE_HOME/tiermem/bench-io.json (~/.cache by default),
# keyed by the filesystems the paths lie on (st_dev, major:minor, of each path or its nearest existing
# ancestor), not by the path strings: two directories on one drive share a measurement, and a path that
# is later mounted elsewhere does not inherit one. A striped run of several paths is one key, the sorted
# set of its filesystems. The best mean GB/s over engines, block sizes and queue depths is kept per mode:
# what `tiermem.plan` divides bytes by is then the fastest this drive was seen to go, so the step time it
# derives is a lower bound.

BENCH_CACHE_FILE = "bench-io.json"


def bench_cache_path() -> str:
    """Where `tiermem bench io` caches its figures (see [Note: bench cache])."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiermem", BENCH_CACHE_FILE)


def filesystem_key(paths: list[str] | tuple[str, ...]) -> str:
    """The cache key of a set of swap directories: the sorted major:minor of the filesystems they lie on."""
    devs = set()
    for path in paths:
        path = os.path.abspath(path)
        while not os.path.exists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        st = os.stat(path)
        devs.add(f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return ",".join(sorted(devs))


def _read_cache(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_bench_results(paths: list[str], results: list[dict[str, Any]], cache: str | None = None) -> str | None:
    """Record the best read and write GB/s of `results` for `paths` in the cache; returns the cache file, or
    None when it could not be written (logged: the benchmark's own output is what counts)."""
    cache = cache or bench_cache_path()
    entry: dict[str, Any] = {"paths": [os.path.abspath(p) for p in paths], "measured": time.time()}
    for mode in ("read", "write"):
        best = max((r for r in results if r["mode"] == mode), key=lambda r: r["gbps_mean"], default=None)
        if best is not None:
            entry[f"{mode}_gbps"] = best["gbps_mean"]
            entry[f"{mode}_setting"] = {**{k: best[k] for k in ("engine", "block_size", "queue_depth", "direct")},
                                        "sqpoll": bool(best.get("sqpoll", False))}
    data = _read_cache(cache)
    try:
        key = filesystem_key(paths)
        data[key] = {**data.get(key, {}), **entry}
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, cache)  # a reader never sees half a file
    except OSError as exc:
        log.warning("could not cache the bench figures in %s: %s", cache, exc.strerror)
        return None
    return cache


def cached_bandwidth(paths: list[str] | tuple[str, ...], cache: str | None = None) -> dict[str, Any] | None:
    """The cached figures for the filesystems of `paths` (`read_gbps`, `write_gbps`, `measured`, ...), or None."""
    try:
        key = filesystem_key(paths)
    except OSError:
        return None
    entry = _read_cache(cache or bench_cache_path()).get(key)
    return entry if isinstance(entry, dict) else None


# [Note: path weights]
# Several nvme.paths are striped in proportion to integer weights ([Note: striping]). For "auto" they come
# from the read GB/s cached per filesystem: the weights are the integers of sum at most MAX_PERIOD that make
# a transfer take least time when each drive reads its share at its own speed (ties: the shorter period,
# so that small transfers still touch every drive). Without a figure for every path, or with two paths on
# one filesystem (one drive's bandwidth, shared), the chunks are dealt equally.

MAX_PERIOD = 12


def weights_for(gbps: list[float]) -> tuple[int, ...]:
    """Integer stripe weights for drives of these bandwidths (see [Note: path weights])."""
    total = sum(gbps)
    best: tuple[float, int, tuple[int, ...]] | None = None
    for period in range(len(gbps), MAX_PERIOD + 1):
        w = tuple(max(1, round(period * g / total)) for g in gbps)
        seconds = max(wi / sum(w) / g for wi, g in zip(w, gbps, strict=True))  # per byte of the transfer
        cand = (round(seconds * total, 6), sum(w), w)  # time relative to the ideal, to six places
        if best is None or cand[:2] < best[:2]:
            best = cand
    assert best is not None
    return best[2]


def path_weights(paths: list[str] | tuple[str, ...], setting: str | tuple[int, ...],
                 cache: str | None = None) -> tuple[tuple[int, ...], str]:
    """The stripe weights for `paths` under `nvme.path_weights` = `setting`, and why (for the plan line)."""
    if not isinstance(setting, str):
        return tuple(setting), "nvme.path_weights"
    if len(paths) == 1:
        return (1,), "one directory"
    try:
        keys = [filesystem_key([p]) for p in paths]
    except OSError:
        keys = []
    if len(set(keys)) < len(paths):
        return (1,) * len(paths), "equal: two directories share a filesystem" if keys else "equal"
    gbps: list[float] = []
    for p in paths:
        figure = (cached_bandwidth([p], cache) or {}).get("read_gbps")
        if not isinstance(figure, (int, float)) or figure <= 0:
            return (1,) * len(paths), f"equal: no `tiermem bench io` read figure for {p}"
        gbps.append(float(figure))
    return weights_for(gbps), "by read GB/s " + ":".join(f"{g:.2f}" for g in gbps)
