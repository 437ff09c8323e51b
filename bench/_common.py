"""The harness the benchmark scripts in bench/ share (they run as `python3 bench/NAME.py`, which puts bench/ on
sys.path): the system header, the worker protocol, the /proc readers, the quiet-machine gate and the engine
bandwidth probe. Each script keeps what it measures; how it measures on this machine lives here, once.

- System header: `describe_system`, `package_versions`, `print_system_header`, `write_json`.
- Worker protocol: every variant runs in its own process (so its peak RSS and its allocator are its own) as
  `python3 SCRIPT KIND SPEC_JSON`; the worker prints one line, a tag and the JSON of its figures (libraries
  print to stdout too), which the parent picks out. `run_worker` is the parent's side, `worker_main` the
  worker's. A worker that raises hands back {"error": type, message and traceback}.
- /proc readers: `proc_io`, `status_bytes`, `peak_rss_bytes`, `reset_peak_rss`, `cpu_busy_seconds`,
  `other_cpu_seconds`.
- Quiet gate: `wait_for_quiet` (the machine is shared; see [Note: quiet gate] in bench/infer_offload.py).
- Bandwidth probe: `engine_bandwidth`, tiermem's own `python3 -m tiermem bench io` on the swap disk, the
  bandwidth the I/O goals use; `tiermem_bench_io` runs that command with any options.
- Small shared pieces: `check_variants` (the --variants flag), `rotated` (the order of a round), `mean_std`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from tiermem.io.bandwidth import system_info

T = TypeVar("T")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, for the system header."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def tiermem_tree() -> dict[str, Any]:
    """The commit tiermem was measured at, and whether tiermem/ had uncommitted changes."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "uncommitted_in_tiermem": bool(git("status", "--porcelain", "--", "tiermem"))}


def package_versions(*names: str) -> dict[str, str]:
    """Each installed package's version, or "not installed", for the system header."""
    import importlib.metadata

    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def describe_system(paths: list[str]) -> dict[str, Any]:
    """What the system header shows: tiermem's system_info for `paths` (the folders measured on), the CPU
    model, the RAM in GiB and the commit tiermem is at."""
    system = system_info(paths)
    system["cpu_model"] = cpu_model()
    system["memory_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    system["tiermem_tree"] = tiermem_tree()
    return system


def print_system_header(title: str, system: dict[str, Any], versions: dict[str, str]) -> None:
    """The first lines every benchmark prints: machine, the paths it measures on, and the versions."""
    print(f"{title}  |  Linux {system['kernel']} {system['machine']}, {system['cpus']} CPUs "
          f"({system['cpu_model']}), {system['memory_gib']:.0f} GiB RAM, Python {system['python']}")
    for p in system["paths"]:
        print(f"  {p['path']}: {p['filesystem']}, device {p['device'] or '?'} ({p['model'] or 'unknown model'})")
    line = "  versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())
    tree = system.get("tiermem_tree")
    if tree:
        line += f"; tiermem at {(tree['commit'] or '?')[:12]}"
        line += " + uncommitted changes" if tree["uncommitted_in_tiermem"] else ""
    print(line)


def write_json(path: str, report: dict[str, Any]) -> None:
    """Write a benchmark's report where docs/benchmarks.md quotes it from."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"JSON written to {path}")


# -- the worker protocol ------------------------------------------------------------------------------
def run_worker(script: str, kind: str, spec: dict[str, Any], *, tag: str, timeout: float,
               env: dict[str, str] | None = None, name: str = "worker", tail_lines: int = 30) -> dict[str, Any]:
    """Run `python3 SCRIPT KIND SPEC_JSON` and return the figures its worker printed after `tag`.

    Raises RuntimeError with the worker's error (its traceback included) when it raised, and with the last
    `tail_lines` lines of its output when it printed no result or ran past `timeout` seconds; `name` says
    which process in those messages."""
    cmd = [sys.executable, os.path.abspath(script), kind, json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{name} timed out after {timeout:.0f} s") from exc
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(tag):
            out: dict[str, Any] = json.loads(line[len(tag):])
            if out.get("error"):
                raise RuntimeError(out["error"])
            return out
    lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()] or ["(no output)"]
    sep = "\n" if tail_lines > 1 else " "  # one line reads better on the line that reports it
    raise RuntimeError(f"{name} exited {proc.returncode} without a result:{sep}" + "\n".join(lines[-tail_lines:]))


def worker_main(tag: str, work: Callable[[dict[str, Any]], dict[str, Any]], spec_json: str) -> int:
    """The worker's side of `run_worker`: run `work(spec)` and print `tag` and its figures as one JSON line."""
    spec = json.loads(spec_json)
    try:
        out = work(spec)
    except Exception as exc:  # reported to the parent with its traceback
        out = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    print(tag + json.dumps(out), flush=True)
    return 0


# -- /proc readers ------------------------------------------------------------------------------------
def proc_io() -> tuple[int, int] | None:
    """(read_bytes, write_bytes) of /proc/self/io: bytes this process made the block layer move (O_DIRECT
    and page faults included), or None where the file cannot be read."""
    got: dict[str, int] = {}
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                got[key] = int(value)
    except (OSError, ValueError):
        return None
    return got.get("read_bytes", 0), got.get("write_bytes", 0)


def status_bytes(field: str) -> int | None:
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes, or None."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak RSS so far: getrusage(RUSAGE_SELF).ru_maxrss, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Restart this process's peak RSS (VmHWM) from its current RSS (Linux: write 5 to /proc/self/clear_refs);
    False where that is not allowed. ru_maxrss is not reset."""
    return _write_proc("/proc/self/clear_refs", "5")


class GcWatch:
    """Python's cyclic garbage collections in this process, by generation: `settle()`, called just before the
    timed steps, runs one full collection (untimed) and from then on counts each collection and its seconds.

    Why settle: the first full collection after the model is built costs 0.18-0.22 s here (about 400,000
    objects tracked once transformers is imported) and comes when the process has made ten collections of
    the middle generation since the last full one; a later full one waits until a quarter as many objects
    again have lived that long (in 30 steps of the training bench after one, tiermem's defaults made none).
    A process whose steps make more young collections (the defaults: 21 in 12 steps, plain PyTorch's loop 2)
    meets that count sooner: it fell in the 6th step for the defaults, inside the timed steps, and after
    them for plain PyTorch. Collected before the timed steps, it falls in none; `report()` says what the
    timed steps still paid."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._began = 0.0
        self._on = False
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._on:
            g = info["generation"]
            self.counts[g] += 1
            self.seconds[g] += time.perf_counter() - self._began

    def settle(self) -> None:
        """One full collection now, not counted; counting starts."""
        self._on = False
        gc.collect()
        self._on = True

    def report(self) -> dict[str, Any]:
        return {"collections_by_generation": list(self.counts), "seconds_by_generation": list(self.seconds)}


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only); whether it was dropped."""
    os.sync()
    return _write_proc("/proc/sys/vm/drop_caches", "3\n")


def _write_proc(path: str, text: str) -> bool:
    try:
        with open(path, "w", encoding="ascii") as f:
            f.write(text)
        return True
    except OSError:
        return False


def cpu_busy_seconds(interrupts: bool = True) -> float | None:
    """Seconds the machine's CPUs were busy since boot, all processes together (from /proc/stat), or None.

    Busy is user + nice + system + steal (time processes ran, or the hypervisor took the CPU away), and with
    `interrupts` also irq + softirq. The inference bench leaves interrupts out: with a cold page cache much
    of that time is its own reads' completions, not other processes."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[7] + (ticks[5] + ticks[6] if interrupts else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def other_cpu_seconds(busy_before: float | None, busy_after: float | None, own_cpu_seconds: float) -> float | None:
    """CPU seconds other processes took between two cpu_busy_seconds() readings, given this process's own
    CPU time in between (/proc/stat counts in ticks of 10 ms), or None when a reading failed."""
    if busy_before is None or busy_after is None:
        return None
    return max(0.0, busy_after - busy_before - own_cpu_seconds)


# Threads of a process by what they do, from their names (/proc/.../comm): gloo's and NCCL's own threads run
# the collectives; the rest besides the main thread are I/O (io_uring's kernel workers, DeepSpeed's aio threads,
# tiermem's completion thread) and helpers.
_COLLECTIVE_THREADS = ("gloo", "pt_gloo", "pt_nccl", "nccl")


def thread_cpu_seconds() -> dict[str, float] | None:
    """This process's CPU seconds (user + system) so far: `total` (every thread, exited ones included), `main`
    (the main thread) and `collectives` (the threads torch.distributed's backends run collectives on); or None
    where /proc cannot be read. The rest of `total` is I/O and helper threads."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(stat_path: str) -> tuple[str, float]:
        with open(stat_path, encoding="ascii", errors="replace") as f:
            text = f.read()
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        return name, (int(rest[11]) + int(rest[12])) / tick  # utime, stime: fields 14 and 15 of stat

    try:
        out = {"total": cpu("/proc/self/stat")[1], "main": 0.0, "collectives": 0.0}
        main = os.getpid()
        for tid in os.listdir("/proc/self/task"):
            try:
                name, secs = cpu(f"/proc/self/task/{tid}/stat")
            except (OSError, ValueError):  # the thread exited meanwhile: its time stays in the total
                continue
            if int(tid) == main:
                out["main"] = secs
            elif name.startswith(_COLLECTIVE_THREADS):
                out["collectives"] += secs
    except (OSError, ValueError):
        return None
    return out


# -- the quiet gate -----------------------------------------------------------------------------------
def wait_for_quiet(max_cores: float, limit_s: float, *, window_s: float = 1.0, pause_s: float = 0.0,
                   interrupts: bool = True) -> dict[str, Any]:
    """Wait until other processes keep fewer than `max_cores` CPUs busy over `window_s` seconds, or until
    `limit_s` seconds have passed (it measures at least once), sleeping `pause_s` between windows.

    Returns {"others_cores": what the last window measured (None if /proc/stat could not be read),
    "waited_seconds": ...}. `interrupts` as in cpu_busy_seconds. The machine these benches run on may be
    shared, and with two cores one busy neighbour slows PyTorch's two threads a lot; see [Note: quiet gate]
    in bench/infer_offload.py."""
    t0 = time.perf_counter()
    while True:
        b0, c0 = cpu_busy_seconds(interrupts), time.process_time()
        time.sleep(window_s)
        b1, c1 = cpu_busy_seconds(interrupts), time.process_time()
        others = other_cpu_seconds(b0, b1, c1 - c0)
        cores = None if others is None else others / window_s
        waited = time.perf_counter() - t0
        if cores is None or cores < max_cores or waited >= limit_s:
            return {"others_cores": cores, "waited_seconds": waited}
        time.sleep(pause_s)


# -- the bandwidth probe ------------------------------------------------------------------------------
def tiermem_bench_io(options: list[str], path: str, timeout: float,
                     env: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], str]:
    """Run `python3 -m tiermem bench io OPTIONS --json --no-progress --path PATH` (in `env`, default this
    process's); return its JSON results and the command as the reports quote it. Raises RuntimeError when it
    fails or prints no results."""
    cmd = [sys.executable, "-m", "tiermem", "bench", "io", *options, "--json", "--no-progress", "--path", path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"tiermem bench io timed out after {timeout:.0f} s") from exc
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["(no output)"]
        raise RuntimeError(f"tiermem bench io exited {proc.returncode}: {lines[-1]}")
    try:
        results: list[dict[str, Any]] = json.loads(proc.stdout)["results"]
    except (ValueError, KeyError) as exc:
        raise RuntimeError(f"tiermem bench io printed no results: {exc}") from exc
    return results, " ".join(["python3", *cmd[1:]])


def engine_bandwidth(path: str, size: str, *, modes: Sequence[str] = ("write", "read"),
                     timeout: float = 900) -> dict[str, Any]:
    """tiermem's own io_uring bandwidth on the swap disk, 3 transfers of `size` in each of `modes`: what
    the benches' I/O goals divide the bytes they move by.

    Returns {"command": ..., MODE: {"gbps_mean", "gbps_std", "gbps_samples", "block_size", "queue_depth",
    "direct"} for each mode}; raises RuntimeError when the run fails or leaves a mode out."""
    options = ["--engine", "io_uring", *(["--mode", modes[0]] if len(modes) == 1 else []), "--size", size,
               "--runs", "3"]
    results, command = tiermem_bench_io(options, path, timeout)
    out: dict[str, Any] = {"command": command}
    for r in results:
        out[r["mode"]] = {k: r[k] for k in ("gbps_mean", "gbps_std", "gbps_samples", "block_size", "queue_depth",
                                            "direct")}
    missing = [m for m in modes if m not in out]
    if missing:
        raise RuntimeError(f"tiermem bench io did not report {' and '.join(missing)}")
    return out


# -- small shared pieces ------------------------------------------------------------------------------
def check_variants(parser: argparse.ArgumentParser, text: str, known: Sequence[str],
                   flag: str = "--variants") -> list[str]:
    """The keys of a comma-separated `flag` value; an unknown key is a usage error naming the known ones."""
    keys = text.split(",")
    unknown = [k for k in keys if k not in known]
    if unknown:
        parser.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return keys


def rotated(items: Sequence[T], rnd: int) -> list[T]:
    """`items` in the order round `rnd` runs them: rotated by one each round, so that no variant always runs
    first or right after the same neighbour."""
    k = rnd % len(items) if items else 0
    return [*items[k:], *items[:k]]


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _read_text(path: str) -> str:
    """The file's text, or '' where it is not there."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def block_device(path: str) -> str:
    """major:minor of the disk holding `path`: a partition's disk, since the kernel throttles whole disks."""
    dev = os.stat(path).st_dev
    device = f"{os.major(dev)}:{os.minor(dev)}"
    sysfs = f"/sys/dev/block/{device}"
    if os.path.exists(os.path.join(sysfs, "partition")):
        return _read_text(os.path.join(os.path.realpath(sysfs), "..", "dev")).strip() or device
    return device


@contextlib.contextmanager
def disk_rate_capped(path: str, read: int | None = None, write: int | None = None) -> Iterator[str]:
    """This process and the children it starts meanwhile in a blkio cgroup whose reads and writes on the disk
    holding `path` are capped at `read` and `write` bytes a second (None: not capped), through the kernel's
    block throttle (v1 blkio.throttle.*_bps_device, or v2 io.max); other processes keep the disk as it is.
    Yields the disk's major:minor. Needs root."""
    device = block_device(path)
    v1 = "/sys/fs/cgroup/blkio"
    if os.path.isdir(v1):
        root = v1
        limits = [(f"blkio.throttle.{kind}_bps_device", f"{device} {rate}")
                  for kind, rate in (("read", read), ("write", write)) if rate is not None]
    elif "io" in _read_text("/sys/fs/cgroup/cgroup.controllers").split():
        root = "/sys/fs/cgroup"
        caps = " ".join(f"{key}={rate}" for key, rate in (("rbps", read), ("wbps", write)) if rate is not None)
        limits = [("io.max", f"{device} {caps}")] if caps else []
    else:
        raise SystemExit("capping a disk's rate needs a blkio cgroup (v1) or the io controller (v2), as root")
    group = os.path.join(root, f"tiermem-bench-{os.getpid()}")
    os.mkdir(group)
    try:
        for name, line in limits:
            with open(os.path.join(group, name), "w") as f:
                f.write(line)
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        yield device
    finally:
        with open(os.path.join(root, "cgroup.procs"), "w") as f:  # back where it was made from
            f.write(str(os.getpid()))
        os.rmdir(group)
