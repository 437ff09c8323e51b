#!/usr/bin/env python3
"""tiermem's I/O engines against fio and DeepSpeed's aio_handle, side by side on one disk in one run.

For each repetition, block size and mode (write, then read), every tool moves the same number of bytes
once, in turn, in the same directory, with the same block size and queue depth:

  fio                 ioengine=io_uring, direct=1 (one job)
  fio fixedbufs       the same with registered buffers (--fixedbufs)
  DeepSpeed aio       deepspeed.ops AsyncIOBuilder().load().aio_handle (libaio, O_DIRECT), one thread
  tiermem io_uring    `python3 -m tiermem bench io --engine io_uring --runs 1 --json`
  tiermem threads     the same with --engine threads

Every tool runs in its own subprocess. The order of the tools rotates with each repetition, so a slow
patch of the shared disk does not always land on the same tool. Reads use O_DIRECT for every tool (the
bytes the device reads are checked against the bytes asked for); writes are O_DIRECT without fsync for
every tool, each into a file freshly fallocated to the full size (tiermem's swap store fallocates its
files, so fio's and DeepSpeed's files are prepared the same way, untimed). CPU time is the process's
user+system seconds over the timed transfer: fio's usr_cpu+sys_cpu x job runtime, tiermem's own
process_time figure, time.process_time() around DeepSpeed's call in its worker. The average request
size at the device comes from /proc/diskstats around each tool's subprocess.

    python3 bench/io_vs_peers.py --json bench/results/io_vs_peers.json

Peers are optional: bench/setup-peers.sh installs them. A missing peer leaves its column out and the
report says why. GB = 1e9 bytes; GiB = 2**30 bytes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from _common import (  # bench/ is on sys.path when run as a script
    describe_system,
    print_system_header,
    rotated,
    run_worker,
    tiermem_bench_io,
    worker_main,
    write_json,
)

from tiermem.io.bandwidth import GB, GIB, block_device_of, disk_stats
from tiermem.sizes import format_size, parse_size

DEFAULT_PATH = "/var/tmp/tiermem-peers"
MODES = ("write", "read")  # write first: each peer's read uses the file its write just left
RESULT_TAG = "IO_VS_PEERS_RESULT "  # marks the worker's JSON line; DeepSpeed logs to stdout too
WRITE_PATTERN = 0x5A  # not zeros: some devices shortcut zero pages
BANDWIDTH_GOAL = 1.0  # tiermem io_uring GB/s >= this x the fastest peer
CPU_GOAL = 1.5  # tiermem io_uring CPU s/GiB <= this x fio's
SUBPROCESS_TIMEOUT_S = 600
DEEPSPEED_BUILD_TIMEOUT_S = 1800  # the first load JIT-builds the op with ninja


@dataclass(frozen=True)
class Tool:
    """One column of the comparison."""

    key: str  # stable name used in the JSON
    label: str  # what the tables print
    peer: bool  # True for fio and DeepSpeed, False for tiermem's engines


TOOLS = (
    Tool("fio", "fio io_uring", True),
    Tool("fio_fixedbufs", "fio io_uring fixedbufs", True),
    Tool("deepspeed", "DeepSpeed aio_handle", True),
    Tool("tiermem_io_uring", "tiermem io_uring", False),
    Tool("tiermem_threads", "tiermem threads", False),
)


# -- device statistics ----------------------------------------------------------------------------
@contextmanager
def device_io(devices: list[str], write: bool) -> Iterator[dict[str, float | None]]:
    """Yield a dict filled on exit with the requests and bytes that reached `devices` in one direction."""
    box: dict[str, float | None] = {"avg_request_kib": None, "device_bytes": None}
    before = disk_stats(devices)
    yield box
    after = disk_stats(devices)
    ios = sectors = 0
    i = 2 if write else 0  # disk_stats: (reads, sectors read, writes, sectors written)
    for dev, a in after.items():
        b = before.get(dev)
        if b is not None:
            ios += a[i] - b[i]
            sectors += a[i + 1] - b[i + 1]
    if devices and after:
        box["device_bytes"] = sectors * 512
        box["avg_request_kib"] = sectors * 512 / 1024 / ios if ios else None


def fallocate_fresh(path: str, size: int) -> None:
    """Replace `path` by a file of `size` allocated but unwritten bytes, as tiermem's store prepares its own."""
    if os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


# -- the tools ------------------------------------------------------------------------------------
def run_fio(path: str, size: int, bs: int, qd: int, mode: str, fixedbufs: bool) -> dict[str, Any]:
    """One fio job; GB/s from bw_bytes, CPU from usr_cpu+sys_cpu over the job's runtime."""
    cmd = ["fio", "--name=peer", f"--filename={path}", f"--rw={mode}", f"--bs={bs}", f"--size={size}",
           f"--iodepth={qd}", "--ioengine=io_uring", "--direct=1", "--numjobs=1", "--fallocate=none",
           "--output-format=json"]
    if fixedbufs:
        cmd.append("--fixedbufs")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    start = proc.stdout.find("{")
    if proc.returncode != 0 or start < 0:
        raise RuntimeError(f"fio exited {proc.returncode}: {_last_line(proc.stderr or proc.stdout)}")
    job = json.loads(proc.stdout[start:])["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}: {_last_line(proc.stderr)}")
    side = job[mode]
    if side["io_bytes"] != size:
        raise RuntimeError(f"fio moved {side['io_bytes']} bytes, expected {size}")
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000
    return {"gbps": side["bw_bytes"] / GB, "cpu_seconds_per_gib": cpu_s / (size / GIB), "direct": True}


def run_deepspeed(path: str, size: int, bs: int, qd: int, mode: str, threads: int) -> dict[str, Any]:
    """One DeepSpeed aio_handle transfer in a worker subprocess (this file with `_deepspeed`, op "run")."""
    spec = {"op": "run", "path": path, "size": size, "block_size": bs, "queue_depth": qd, "mode": mode,
            "threads": threads}
    out = deepspeed_worker_process(spec, SUBPROCESS_TIMEOUT_S)
    return {"gbps": size / out["seconds"] / GB, "cpu_seconds_per_gib": out["cpu_seconds"] / (size / GIB),
            "direct": True}  # its open_file() always adds O_DIRECT (checked against the device bytes too)


def run_tiermem(directory: str, size: int, bs: int, qd: int, mode: str, engine: str) -> dict[str, Any]:
    """One `tiermem bench io` run (its own swap store under `directory`, removed when it exits)."""
    results, _ = tiermem_bench_io(["--size", str(size), "--block-size", str(bs), "--queue-depth", str(qd),
                                   "--engine", engine, "--mode", mode, "--runs", "1"], directory, SUBPROCESS_TIMEOUT_S)
    result = results[0]
    return {"gbps": result["gbps_mean"], "cpu_seconds_per_gib": result["cpu_seconds_per_gib"],
            "direct": result["direct"], "tiermem_avg_request_kib": result["avg_request_kib"]}


def deepspeed_worker_process(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """deepspeed_worker in its own process, on the CPU accelerator; its result, or RuntimeError."""
    return run_worker(__file__, "_deepspeed", spec, tag=RESULT_TAG, timeout=timeout,
                      env=dict(os.environ, DS_ACCELERATOR="cpu"), name="DeepSpeed worker", tail_lines=1)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def deepspeed_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs inside the subprocess: op `probe` loads (and on first use builds) the op; `run` times one call."""
    result: dict[str, Any] = {}
    try:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            raise RuntimeError("AsyncIOBuilder is not compatible here (libaio-dev missing? see setup-peers.sh)")
        op = builder.load(verbose=False)
        if spec["op"] == "probe":
            result = {"deepspeed": importlib.metadata.version("deepspeed"), "torch": torch.__version__}
        else:
            path, size, bs, qd, mode, threads = (spec[k] for k in ("path", "size", "block_size", "queue_depth",
                                                                   "mode", "threads"))
            # DeepSpeed's own defaults for ZeRO-Infinity's aio: submit all at once, overlap events.
            handle = op.aio_handle(bs, qd, False, True, threads)
            buf = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))  # page-locked, untimed
            buf.fill_(WRITE_PATTERN if mode == "write" else 0)
            cpu0, t0 = time.process_time(), time.perf_counter()
            rc = handle.sync_pwrite(buf, path) if mode == "write" else handle.sync_pread(buf, path)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            if rc < 0:
                raise RuntimeError(f"aio_handle {mode} of {path} returned {rc}")
            if mode == "read" and not (int(buf[0]) == int(buf[-1]) == WRITE_PATTERN):
                raise RuntimeError(f"aio_handle read of {path} returned data its write did not leave")
            handle.free_cpu_locked_tensor(buf)
            result = {"seconds": seconds, "cpu_seconds": cpu}
    except Exception as exc:  # one line, without the traceback: the parent records it as why the column is missing
        result = {"error": f"{type(exc).__name__}: {exc}"}
    return result


# -- the run --------------------------------------------------------------------------------------
def probe_peers(threads: int) -> tuple[dict[str, str], dict[str, str]]:
    """(reason a tool is unavailable, by key) and (tool versions) for the header."""
    missing: dict[str, str] = {}
    versions: dict[str, str] = {}
    fio = shutil.which("fio")
    if fio is None:
        missing["fio"] = missing["fio_fixedbufs"] = "fio not found on PATH (bash bench/setup-peers.sh)"
    else:
        versions["fio"] = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()
    try:
        importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        missing["deepspeed"] = "deepspeed is not installed (bash bench/setup-peers.sh)"
    else:
        print("loading DeepSpeed's aio op (built with ninja on first use; may take minutes)...", file=sys.stderr)
        try:
            out = deepspeed_worker_process({"op": "probe"}, DEEPSPEED_BUILD_TIMEOUT_S)
            versions["deepspeed"] = f"{out['deepspeed']} (aio_handle, libaio, intra_op_parallelism={threads})"
            versions["torch"] = out["torch"]
        except RuntimeError as exc:
            missing["deepspeed"] = f"DeepSpeed's aio op could not be loaded: {exc}"
    for name in ("tiermem", "torch"):
        if name not in versions:
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                versions[name] = "not installed"
    return missing, versions


def measure(tool: Tool, directory: str, size: int, bs: int, qd: int, mode: str, threads: int,
            devices: list[str]) -> dict[str, Any]:
    """Prepare (untimed) and run one transfer of `tool`; return its figures or an 'error'."""
    peer_file = os.path.join(directory, f"{tool.key.split('_')[0]}.dat")  # fio variants share one file
    write = mode == "write"
    try:
        if tool.peer:
            if write:
                fallocate_fresh(peer_file, size)
            elif not os.path.exists(peer_file) or os.path.getsize(peer_file) < size:
                raise RuntimeError("no file left by this tool's write run to read")
        with device_io(devices, write) as dev:
            if tool.key.startswith("fio"):
                out = run_fio(peer_file, size, bs, qd, mode, fixedbufs=tool.key == "fio_fixedbufs")
            elif tool.key == "deepspeed":
                out = run_deepspeed(peer_file, size, bs, qd, mode, threads)
            else:
                out = run_tiermem(directory, size, bs, qd, mode, tool.key.removeprefix("tiermem_"))
        out.update(dev)
        return out
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}


def summarize(rows: list[dict[str, Any]], tools: list[Tool], block_sizes: list[int],
              missing: dict[str, str]) -> list[dict[str, Any]]:
    """Mean ± stdev per (tool, mode, block size) over the repetitions that succeeded."""
    out = []
    for mode in MODES:
        for bs in block_sizes:
            for tool in tools:
                mine = [r for r in rows if (r["tool"], r["mode"], r["block_size"]) == (tool.key, mode, bs)]
                ok = [r for r in mine if "error" not in r]
                entry: dict[str, Any] = {"tool": tool.key, "label": tool.label, "mode": mode, "block_size": bs,
                                         "runs": len(ok), "failed": len(mine) - len(ok)}
                if ok:
                    g = [r["gbps"] for r in ok]
                    reqs = [r["avg_request_kib"] for r in ok if r["avg_request_kib"] is not None]
                    dev_bytes = [r["device_bytes"] for r in ok if r["device_bytes"] is not None]
                    entry.update({
                        "gbps_mean": statistics.fmean(g),
                        "gbps_std": statistics.stdev(g) if len(g) > 1 else 0.0,
                        "gbps_samples": g,
                        "cpu_seconds_per_gib": statistics.fmean(r["cpu_seconds_per_gib"] for r in ok),
                        "avg_request_kib": statistics.fmean(reqs) if reqs else None,
                        "device_bytes_per_byte": statistics.fmean(dev_bytes) / ok[0]["bytes"] if dev_bytes else None,
                        "direct": all(r["direct"] for r in ok),
                    })
                else:
                    entry["error"] = mine[-1]["error"] if mine else missing.get(tool.key, "not run")
                out.append(entry)
    return out


def compare(summary: list[dict[str, Any]], rows: list[dict[str, Any]], block_sizes: list[int],
            repeats: int) -> list[dict[str, Any]]:
    """Per (mode, block size): tiermem / fastest peer, paired per repetition too, and CPU vs fio."""
    by_run = {(r["tool"], r["mode"], r["block_size"], r["rep"]): float(r["gbps"]) for r in rows if "error" not in r}
    out = []
    for mode in MODES:
        for bs in block_sizes:
            here = {s["tool"]: s for s in summary if s["mode"] == mode and s["block_size"] == bs and "gbps_mean" in s}
            peers = {k: s for k, s in here.items() if next(t for t in TOOLS if t.key == k).peer}
            fios = {k: s for k, s in peers.items() if k.startswith("fio")}
            entry: dict[str, Any] = {"mode": mode, "block_size": bs, "peers_measured": sorted(peers)}
            if peers:
                best = max(peers.values(), key=lambda s: s["gbps_mean"])
                entry.update({"best_peer": best["tool"], "best_peer_gbps": best["gbps_mean"]})
            if fios:
                lean = min(fios.values(), key=lambda s: s["cpu_seconds_per_gib"])
                entry.update({"fio_least_cpu": lean["tool"], "fio_cpu_seconds_per_gib": lean["cpu_seconds_per_gib"]})
            for engine in ("tiermem_io_uring", "tiermem_threads"):
                mine = here.get(engine)
                if mine is None or not peers:
                    continue
                paired = []  # same repetition, so a slow moment of the disk hits both sides of the ratio
                for r in range(repeats):
                    t = by_run.get((engine, mode, bs, r))
                    p = [g for g in (by_run.get((k, mode, bs, r)) for k in peers) if g is not None]
                    if t is not None and p:
                        paired.append(t / max(p))
                ratio: dict[str, Any] = {
                    "gbps_ratio": mine["gbps_mean"] / entry["best_peer_gbps"],
                    "paired_ratio_mean": statistics.fmean(paired) if paired else None,
                    "paired_ratio_std": statistics.stdev(paired) if len(paired) > 1 else 0.0,
                }
                if fios:
                    ratio["cpu_ratio_vs_fio"] = mine["cpu_seconds_per_gib"] / entry["fio_cpu_seconds_per_gib"]
                entry[engine] = ratio
            out.append(entry)
    return out


def goals(ratios: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether tiermem's io_uring engine met the issue's two goals in each (mode, block size)."""
    cases = []
    for e in ratios:
        r = e.get("tiermem_io_uring")
        case = {"mode": e["mode"], "block_size": e["block_size"], "best_peer": e.get("best_peer")}
        if r is None:
            case.update({"bandwidth_held": None, "cpu_held": None, "why": "tiermem io_uring or all peers missing"})
        else:
            case.update({"gbps_ratio": r["gbps_ratio"], "bandwidth_held": r["gbps_ratio"] >= BANDWIDTH_GOAL,
                         "cpu_ratio_vs_fio": r.get("cpu_ratio_vs_fio"),
                         "cpu_held": (r["cpu_ratio_vs_fio"] <= CPU_GOAL) if "cpu_ratio_vs_fio" in r else None})
        cases.append(case)
    return {"bandwidth_goal": f"tiermem io_uring GB/s >= {BANDWIDTH_GOAL} x the fastest peer",
            "cpu_goal": f"tiermem io_uring CPU s/GiB <= {CPU_GOAL} x fio's (the fio variant using less CPU)",
            "cases": cases,
            "bandwidth_held_everywhere": all(c["bandwidth_held"] for c in cases),
            "cpu_held_everywhere": all(c["cpu_held"] for c in cases)}


# -- printing -------------------------------------------------------------------------------------
def print_header(system: dict[str, Any], versions: dict[str, str], missing: dict[str, str], args: Any,
                 size: int, block_sizes: list[int]) -> None:
    print_system_header("tiermem I/O engine vs peers", system, versions)
    print(f"  {format_size(size)} per transfer; blocks {', '.join(format_size(b) for b in block_sizes)}; "
          f"queue depth {args.queue_depth}; {args.repeats} repetitions, tools in rotating order; O_DIRECT")
    for key, why in missing.items():
        print(f"  missing column {key}: {why}")
    print(flush=True)


def print_tables(summary: list[dict[str, Any]], ratios: list[dict[str, Any]], verdict: dict[str, Any]) -> None:
    head = (f"{'mode':<5} {'block':>8}  {'tool':<23} {'GB/s mean ± sd':>16} {'CPU s/GiB':>10} "
            f"{'dev req KiB':>12} {'dev/asked':>9}")
    print(head)
    print("-" * len(head))
    for s in summary:
        lead = f"{s['mode']:<5} {format_size(s['block_size']):>8}  {s['label']:<23}"
        if "gbps_mean" not in s:
            print(f"{lead} missing: {s['error']}")
            continue
        req = f"{s['avg_request_kib']:.0f}" if s["avg_request_kib"] else "?"
        dev = f"{s['device_bytes_per_byte']:.2f}" if s["device_bytes_per_byte"] is not None else "?"
        gb = f"{s['gbps_mean']:.2f} ± {s['gbps_std']:.2f}"
        fails = f"  ({s['failed']} failed)" if s["failed"] else ""
        print(f"{lead} {gb:>16} {s['cpu_seconds_per_gib']:>10.3f} {req:>12} {dev:>9}{fails}")
    print()
    head = (f"{'mode':<5} {'block':>8}  {'fastest peer':<23} {'GB/s':>6}  {'engine':<9} {'ratio':>6} "
            f"{'paired ratio':>13} {'CPU vs fio':>10}")
    print(head)
    print("-" * len(head))
    for e in ratios:
        for engine in ("tiermem_io_uring", "tiermem_threads"):
            r = e.get(engine)
            if r is None:
                continue
            label = next(t.label for t in TOOLS if t.key == e["best_peer"])
            pr = f"{r['paired_ratio_mean']:.2f} ± {r['paired_ratio_std']:.2f}" if r["paired_ratio_mean"] else "?"
            cpu = f"{r['cpu_ratio_vs_fio']:.2f}" if "cpu_ratio_vs_fio" in r else "?"
            print(f"{e['mode']:<5} {format_size(e['block_size']):>8}  {label:<23} {e['best_peer_gbps']:>6.2f}  "
                  f"{engine.removeprefix('tiermem_'):<9} {r['gbps_ratio']:>6.2f} {pr:>13} {cpu:>10}")
    print()
    print(f"goals for tiermem io_uring: {verdict['bandwidth_goal']}; {verdict['cpu_goal']}")
    for key, why in verdict.get("peers_missing", {}).items():
        print(f"  (checked without {key}: {why})")
    for c in verdict["cases"]:
        if c["bandwidth_held"] is None:
            print(f"  {c['mode']:<5} {format_size(c['block_size']):>8}: not checked ({c['why']})")
            continue
        cpu = "?" if c["cpu_held"] is None else ("held" if c["cpu_held"] else "NOT held")
        print(f"  {c['mode']:<5} {format_size(c['block_size']):>8}: bandwidth "
              f"{'held' if c['bandwidth_held'] else 'NOT held'} ({c['gbps_ratio']:.2f} x), CPU {cpu}"
              + (f" ({c['cpu_ratio_vs_fio']:.2f} x)" if c["cpu_ratio_vs_fio"] is not None else ""))


# -- main -----------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default=DEFAULT_PATH, help=f"directory on the disk to test (default {DEFAULT_PATH})")
    p.add_argument("--size", default="2GiB", help="bytes per transfer (default 2GiB)")
    p.add_argument("--block-sizes", default="1MiB,4MiB", help="comma-separated request sizes (default 1MiB,4MiB)")
    p.add_argument("--queue-depth", type=int, default=32, help="requests in flight (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions; each runs every tool once (default 3)")
    p.add_argument("--deepspeed-threads", type=int, default=1,
                   help="DeepSpeed aio intra_op_parallelism (default 1, like fio's one job and tiermem's one ring)")
    p.add_argument("--json", metavar="OUT.json", default=None, help="also write every figure to this file")
    args = p.parse_args(argv)
    try:
        args.size_bytes = parse_size(args.size, what="--size")
        args.block_size_list = [parse_size(b, what="--block-sizes") for b in args.block_sizes.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    if args.size_bytes <= 0:
        p.error("--size: expected a positive size such as 2GiB")
    for b in args.block_size_list:
        if b <= 0 or b % 4096 or args.size_bytes % b:
            p.error(f"--block-sizes: each must be a positive multiple of 4096 that divides --size, got {b}")
    if args.queue_depth < 1 or args.repeats < 1 or args.deepspeed_threads < 1:
        p.error("--queue-depth, --repeats and --deepspeed-threads must be >= 1")
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["_deepspeed"]:
        return worker_main(RESULT_TAG, deepspeed_worker, argv[1])
    args = parse_args(argv)
    size, block_sizes, qd = args.size_bytes, args.block_size_list, args.queue_depth
    t_start = time.perf_counter()
    created = not os.path.isdir(args.path)
    os.makedirs(args.path, exist_ok=True)
    directory = os.path.abspath(args.path)
    devices = [d for d in [block_device_of(directory)] if d]

    system = describe_system([directory])
    missing, versions = probe_peers(args.deepspeed_threads)
    for engine, state in system["engines"].items():
        if state != "available":
            missing[f"tiermem_{engine}"] = state
    print_header(system, versions, missing, args, size, block_sizes)
    tools = [t for t in TOOLS if t.key not in missing]

    rows: list[dict[str, Any]] = []
    t_measure = time.perf_counter()
    try:
        for rep in range(args.repeats):
            order = rotated(tools, rep)
            for bs in block_sizes:
                for mode in MODES:
                    for tool in order:
                        out = measure(tool, directory, size, bs, qd, mode, args.deepspeed_threads, devices)
                        row = {"rep": rep, "tool": tool.key, "mode": mode, "block_size": bs, "queue_depth": qd,
                               "bytes": size, **out}
                        rows.append(row)
                        shown = (f"{out['gbps']:.2f} GB/s, {out['cpu_seconds_per_gib']:.3f} CPU s/GiB"
                                 if "error" not in out else f"failed: {out['error']}")
                        print(f"[{rep + 1}/{args.repeats}] {mode:<5} {format_size(bs):>8} {tool.label:<23} {shown}",
                              file=sys.stderr, flush=True)
    finally:
        for name in ("fio.dat", "deepspeed.dat"):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
        if created:
            try:
                os.rmdir(directory)
            except OSError:
                pass  # something else lives there now; leave it
    measure_s = time.perf_counter() - t_measure

    for r in rows:  # reads that did not reach the device would be cache hits, not disk figures
        if "error" not in r and r["mode"] == "read" and r.get("device_bytes") is not None \
                and r["device_bytes"] < 0.9 * size:
            r["error"] = f"only {r['device_bytes']} of {size} bytes were read from the device (page cache?)"
    summary = summarize(rows, list(TOOLS), block_sizes, missing)
    ratios = compare(summary, rows, block_sizes, args.repeats)
    verdict = goals(ratios)
    verdict["peers_missing"] = {k: v for k, v in missing.items() if not k.startswith("tiermem")}
    print_tables(summary, ratios, verdict)
    wall_s = time.perf_counter() - t_start
    print(f"\nmeasurements took {measure_s:.0f} s; whole run {wall_s:.0f} s")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        report = {
            "command": " ".join(["python3", "bench/io_vs_peers.py", *argv]),
            "system": system,
            "versions": versions,
            "missing": missing,
            "config": {"path": directory, "bytes": size, "block_sizes": block_sizes, "queue_depth": qd,
                       "repeats": args.repeats, "deepspeed_intra_op_parallelism": args.deepspeed_threads,
                       "order": "per repetition, per block size, write then read, every tool once (rotating)",
                       "units": "GB = 1e9 bytes, GiB = 2**30 bytes, KiB = 1024 bytes"},
            "summary": summary,
            "ratios": ratios,
            "goals": verdict,
            "measurements": rows,
            "measure_seconds": measure_s,
            "wall_seconds": wall_s,
        }
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
