#!/usr/bin/env python3
"""Soak: train a small GPT-2 from NVMe tiers for thousands of steps and check that what the process holds
stays flat (issue 12). Not part of CI.

The model is a GPT-2 (transformers GPT2Config(n_layer=4, n_embd=128, n_head=2, vocab_size=1000,
n_positions=64, use_cache=False), dropout off, fp32, the embedding and the head tied), trained with
torch.optim.AdamW(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True) on batches of
--batch x --seq random token ids (torch.Generator seeded with INPUT_SEED; the weights with SEED), loss =
model(ids, labels=ids).loss, under

    tiermem.tiered_offload(model, optimizer=opt, device=cpu, params.tier=nvme, optimizer.tier=nvme,
                           grads.tier=cpu, activations.tier=nvme, activations.min_bytes=--activations-min-bytes,
                           activations.buffer=--activations-buffer, memory.host_budget=--host-budget,
                           wrap.min_unit_bytes=--min-unit-bytes, nvme.paths=[a fresh directory under --dir])

A step is tm.optimizer.zero_grad(), forward, tm.backward(loss), tm.optimizer.step(). The host budget is
below the training state (fp32 parameters, gradients and two Adam moments), so parameter and optimizer
units are read from and written to the swap file every step, and saved activations go to swap in forward
and come back in backward. wrap.min_unit_bytes is lowered from its 1 MiB default so that each of the four
0.79 MB transformer blocks is a unit of its own; with the default the whole model is one or two units, and
the budget would have to hold all of it.

Before entry the script runs one forward without autograd on a batch of zeros (the weights are not
changed and the token generator is not used): PyTorch starts a thread of its own at its first parallel
operator, and this way the thread count before entry already has it.

Once after entering the context (step 0) and then every --every steps (and after the last), the script
samples:
  rss                VmRSS of /proc/self/status
  fds                len(os.listdir('/proc/self/fd'))
  threads_python     threading.active_count()
  threads_os         Threads of /proc/self/status (every thread of the process, native ones included)
  io_wq_workers      how many of those are io_uring's io-wq workers (/proc/self/task/*/comm "iou-wrk-<n>"):
                     threads the kernel starts for requests it cannot issue without blocking and ends
                     once idle
  threads_own        threads_os less io_wq_workers
  pool_pinned        the host pool's size if tm.swapper.pool.pinned (page-locked for CUDA), else 0; on a
                     CPU compute device it is never pinned, so this is 0 throughout
  vm_pin             VmPin of /proc/self/status: pages the kernel holds pinned for the process (io_uring's
                     registered buffers count here)
  host_now           tm.stats()['now_bytes']['host'], the ledger's host bytes held now
  pool_largest_free  the largest free piece of the host pool's partition arena (shown, not judged): a
                     partition needs one piece, so this says how fragmented the pool is between steps
  swap_size          the sum of st_size over every file under the swap directory (os.walk, lstat)
  swap_allocated     the sum of st_blocks * 512 over the same files (the disk space they take)
  swap_files         how many files there are
  read_per_step      tm.stats() bytes_read over the steps since the previous sample, per step
  written_per_step   tm.stats() bytes_written, the same way
  step_seconds       the mean wall time of the steps since the previous sample
  loss               the mean loss of those steps (every step's loss and time are in the JSON too)

At the end each series is fitted with a least-squares line over the second half of the run (the samples
after step --steps / 2; the first half is warm-up), and its slope is reported per 1000 steps with the
first and the last value. A series is flat when:
  rss                the fitted slope is below RSS_SLOPE_LIMIT (20 MB per 1000 steps)
  fds, threads_python, threads_own, pool_pinned, vm_pin, swap_size, swap_allocated, swap_files
                     it takes one value over the whole second half (max == min)
  io_wq_workers, threads_os
                     the fitted slope is within +-IO_WQ_SLOPE_LIMIT (0.5 threads per 1000 steps): the
                     kernel's workers come and go, so these are judged for a trend, not for one value
  host_now           the fitted slope is below HOST_SLOPE_LIMIT (256 KiB per 1000 steps) and no sample is
                     above the host budget (which of the units are in memory at a sample varies with the
                     timing of the I/O, by up to a unit)
  read_per_step, written_per_step
                     the fitted slope is below RELATIVE_LIMIT (2%) of the series' second-half mean per 1000
                     steps (which units a step finds in memory varies with the timing of the I/O)
  step_seconds       the same with STEP_TIME_LIMIT (10%); the machine is shared, so this one is a hint and
                     left out of the verdict
The loss is shown, not judged. After the context is left the script also checks that the open descriptors
and the threads (io-wq workers aside) are back to their count before entry and that the swap directory is
empty (a joined thread leaves the kernel's task list a moment after Python sees it end, and io-wq workers
end on their own once the ring is closed, so it waits up to EXIT_SETTLE_S, 2 s, for the threads); then
it drops the handle (del tm; gc.collect()) and reads RSS, descriptors and threads once more.
A step that raises ends the steps: the error and its step go into the output, and the rest is reported
over the samples taken before it. The exit status is 0 when every judged series was flat and those checks held, else 1.

    python3 bench/soak.py                          # 2000 steps; bench/results/soak.json and soak.png
    python3 bench/soak.py --quick                  # 100 steps, outputs under /tmp unless --json/--plot

GB = 1e9 bytes; MB = 1e6 bytes; KiB = 2**10 bytes; MiB = 2**20 bytes.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from _common import (  # bench/ is on sys.path when run as a script
    ROOT,
    cpu_busy_seconds,
    describe_system,
    package_versions,
    print_system_header,
    write_json,
)
from train_offload import model_info

from tiermem.sizes import format_size, parse_size

DEFAULT_DIR = "/var/tmp/tiermem-soak"
DEFAULT_JSON = os.path.join(ROOT, "bench", "results", "soak.json")
DEFAULT_PLOT = os.path.join(ROOT, "bench", "results", "soak.png")
QUICK_JSON = os.path.join(tempfile.gettempdir(), "tiermem-soak-quick.json")  # a smoke run keeps the results
QUICK_PLOT = os.path.join(tempfile.gettempdir(), "tiermem-soak-quick.png")
SEED = 0  # the model's initial weights
INPUT_SEED = 1234  # the token ids
ADAMW: dict[str, Any] = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "fused": True}
STATE_BYTES_PER_PARAM = 16  # fp32 parameter + gradient + exp_avg + exp_avg_sq
# Flatness thresholds over the second half (see the docstring)
RSS_SLOPE_LIMIT = 20 * 10**6  # bytes per 1000 steps
HOST_SLOPE_LIMIT = 256 * 1024  # bytes per 1000 steps
IO_WQ_SLOPE_LIMIT = 0.5  # threads per 1000 steps
RELATIVE_LIMIT = 0.02  # of the series' mean, per 1000 steps
STEP_TIME_LIMIT = 0.10  # of the mean step time, per 1000 steps
EXIT_SETTLE_S = 2.0  # how long the exit check waits for threads to leave
IO_WQ_PREFIX = "iou-wrk-"  # io_uring's kernel workers: threads of this process that the kernel starts and ends


# name, label, unit for the table, divisor for that unit, criterion (see summarize)
SERIES: tuple[tuple[str, str, str, float, str], ...] = (
    ("rss", "RSS (VmRSS)", "MB", 1e6, "rss"),
    ("fds", "open descriptors", "", 1, "constant"),
    ("threads_python", "threads (threading)", "", 1, "constant"),
    ("threads_own", "threads less io-wq workers", "", 1, "constant"),
    ("io_wq_workers", "io_uring io-wq workers", "", 1, "threads_trend"),
    ("threads_os", "threads (/proc Threads)", "", 1, "threads_trend"),
    ("pool_pinned", "pool pinned for CUDA", "MB", 1e6, "constant"),
    ("vm_pin", "VmPin (kernel-pinned)", "MB", 1e6, "constant"),
    ("host_now", "ledger host now", "MB", 1e6, "host"),
    ("pool_largest_free", "pool's largest free piece", "MB", 1e6, "none"),
    ("swap_size", "swap files st_size", "MB", 1e6, "constant"),
    ("swap_allocated", "swap files allocated", "MB", 1e6, "constant"),
    ("swap_files", "swap files", "", 1, "constant"),
    ("read_per_step", "read per step", "MB", 1e6, "relative"),
    ("written_per_step", "written per step", "MB", 1e6, "relative"),
    ("step_seconds", "step time", "s", 1, "hint"),
    ("loss", "loss", "", 1, "none"),
)


# -- what the process holds ---------------------------------------------------------------------------
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, VmPin, VmLck (bytes) and Threads of /proc/self/status."""
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "VmPin", "VmLck"):
                out[key] = int(value.split()[0]) * 1024
            elif key == "Threads":
                out[key] = int(value)
    return out


def open_fds() -> int:
    """Open descriptors of this process (the one listdir itself holds included, the same every time)."""
    return len(os.listdir("/proc/self/fd"))


def thread_names() -> dict[str, int]:
    """How many of this process's threads have each name (/proc/self/task/*/comm, the digits of a trailing
    thread number dropped: io_uring's kernel workers are iou-wrk-<tid>)."""
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                name = f.read().strip().rstrip("0123456789")
        except OSError:  # the thread ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def pool_largest_free(pool: Any) -> int | None:
    """The largest free piece of the host pool's partition arena: a partition needs one piece, so this,
    not the free total, says whether the next one fits."""
    return pool.largest_free() if hasattr(pool, "largest_free") else None


def tree_sizes(path: str) -> tuple[int, int, int]:
    """(sum of st_size, sum of st_blocks * 512, number of files) over every file under `path`."""
    size = blocks = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:  # removed between the listing and the stat
                continue
            size += st.st_size
            blocks += st.st_blocks * 512
            files += 1
    return size, blocks, files


# -- the fit ------------------------------------------------------------------------------------------
def fit_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs (None with fewer than two distinct xs)."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def summarize(samples: list[dict[str, Any]], half: int, host_budget: int) -> dict[str, dict[str, Any]]:
    """First/last value, second-half slope per 1000 steps, min/max/mean and the flat verdict of each series."""
    out: dict[str, dict[str, Any]] = {}
    for name, label, unit, _, criterion in SERIES:
        pts = [(s["step"], s[name]) for s in samples if s.get(name) is not None]
        late = [(x, y) for x, y in pts if x > half]
        ys = [y for _, y in late]
        slope = fit_slope([x for x, _ in late], ys)
        per_1000 = None if slope is None else slope * 1000
        mean = statistics.fmean(ys) if ys else None
        span = (late[-1][0] - late[0][0]) if late else 0
        rec: dict[str, Any] = {
            "label": label, "unit": unit, "criterion": criterion,
            "first": pts[0][1] if pts else None, "first_step": pts[0][0] if pts else None,
            "last": pts[-1][1] if pts else None, "last_step": pts[-1][0] if pts else None,
            "second_half_samples": len(late), "second_half_min": min(ys) if ys else None,
            "second_half_max": max(ys) if ys else None, "second_half_mean": mean,
            "second_half_std": statistics.pstdev(ys) if len(ys) > 1 else None,
            "slope_per_1000_steps": per_1000,
            "fitted_growth_over_second_half": None if slope is None else slope * span,
        }
        flat: bool | None = None
        if per_1000 is None or not ys:
            limit = None
        elif criterion == "constant":
            flat, limit = max(ys) == min(ys), "one value over the second half"
        elif criterion == "rss":
            flat, limit = per_1000 < RSS_SLOPE_LIMIT, f"slope < {RSS_SLOPE_LIMIT / 1e6:.0f} MB per 1000 steps"
        elif criterion == "threads_trend":
            flat = abs(per_1000) < IO_WQ_SLOPE_LIMIT
            limit = f"|slope| < {IO_WQ_SLOPE_LIMIT} threads per 1000 steps (io-wq workers come and go)"
        elif criterion == "host":
            flat = per_1000 < HOST_SLOPE_LIMIT and max(v for _, v in pts) <= host_budget
            limit = f"slope < {HOST_SLOPE_LIMIT // 1024} KiB per 1000 steps, never above the host budget"
        elif criterion == "relative":
            flat = per_1000 < RELATIVE_LIMIT * (mean or 0) or (per_1000 <= 0 and mean == 0)
            limit = f"slope < {RELATIVE_LIMIT:.0%} of the mean per 1000 steps"
        elif criterion == "hint":  # the machine is shared: a hint, left out of the verdict
            flat = per_1000 < STEP_TIME_LIMIT * (mean or 0)
            limit = f"slope < {STEP_TIME_LIMIT:.0%} of the mean per 1000 steps; a hint, not judged"
        else:
            limit = "not judged"
        rec["flat"], rec["limit"] = flat, limit
        out[name] = rec
    return out


# -- the run ------------------------------------------------------------------------------------------
def build_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab_size=args.vocab,
                     n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg).train()


def sample(tm: Any, step: int, swap_dir: str) -> dict[str, Any]:
    """One sample of what the process and tiermem hold now (see the docstring)."""
    st = proc_status()
    names = thread_names()
    io_wq = names.get(IO_WQ_PREFIX, 0)
    stats = tm.stats()
    pool = tm.swapper.pool
    size, allocated, files = tree_sizes(swap_dir)
    return {
        "step": step, "time": time.perf_counter(),
        "rss": st["VmRSS"], "hwm": st["VmHWM"], "fds": open_fds(),
        "threads_python": threading.active_count(), "threads_os": st["Threads"], "thread_names": names,
        "io_wq_workers": io_wq, "threads_own": st["Threads"] - io_wq,
        "pool_pinned": pool.nbytes if pool.pinned else 0, "vm_pin": st.get("VmPin"), "vm_lck": st.get("VmLck"),
        "host_now": stats["now_bytes"]["host"], "host_peak": stats["peak_bytes"]["host"],
        "pool_largest_free": pool_largest_free(pool),
        "nvme_now": stats["now_bytes"]["nvme"],
        "swap_size": size, "swap_allocated": allocated, "swap_files": files,
        "bytes_read_total": stats["bytes_read"], "bytes_written_total": stats["bytes_written"],
        "stall_seconds_total": stats["stall_seconds"], "evictions_total": stats["evictions"],
        "activations_kept_bytes_total": stats.get("activations_kept_bytes"),
        "activations_saved_bytes_total": stats.get("activations_saved_bytes"),
    }


def after_state(swap_dir: str) -> dict[str, Any]:
    """What the process holds after the context: descriptors, threads, RSS, anything left in the swap directory."""
    st = proc_status()
    return {"fds": open_fds(), "threads_os": st["Threads"], "threads_python": threading.active_count(),
            "thread_names": thread_names(), "rss": st["VmRSS"], "swap_files_left": tree_sizes(swap_dir)[2],
            "entries_left": sorted(os.listdir(swap_dir))}


def run(args: argparse.Namespace, swap_dir: str) -> dict[str, Any]:
    import torch

    import tiermem

    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    overrides: dict[str, Any] = {
        "device": "cpu", "params.tier": "nvme", "optimizer.tier": "nvme", "grads.tier": "cpu",
        "activations.tier": "nvme", "activations.min_bytes": args.activations_min_bytes,
        "activations.buffer": args.activations_buffer, "memory.host_budget": args.host_budget,
        "wrap.min_unit_bytes": args.min_unit_bytes, "nvme.paths": [swap_dir],
    }
    gen = torch.Generator().manual_seed(INPUT_SEED)
    # PyTorch starts a thread of its own at the first parallel operator; one forward without autograd (the
    # weights untouched, the token generator unused) starts it before entry, so that the thread count after
    # exit is compared with one that already has it
    with torch.no_grad():
        model(torch.zeros(args.batch, args.seq, dtype=torch.long))
    before: dict[str, Any] = {"fds": open_fds(), "threads_os": proc_status()["Threads"],
                              "threads_python": threading.active_count(), "thread_names": thread_names(),
                              "rss": proc_status()["VmRSS"]}
    step_seconds: list[float] = []
    losses: list[float] = []
    samples: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    failure: dict[str, Any] | None = None
    t_run = time.perf_counter()
    with tiermem.tiered_offload(model, optimizer=opt, **overrides) as tm:
        info = {"units": len(tm.units), "unit_bytes": [u.nbytes for u in tm.units],
                "pool_bytes": tm.swapper.pool.nbytes, "engine": tm.swapper.engine.name,
                "cpu_allocator": "tiermem" if tiermem.cpu_allocator.cpu_allocator_installed() else "torch"}
        run_dirs = sorted(os.listdir(swap_dir))
        info["run_directories"] = run_dirs
        print(f"  entered: {len(tm.units)} units ({', '.join(format_size(b) for b in info['unit_bytes'])}), host pool "
              f"{format_size(info['pool_bytes'])}, engine {info['engine']}, CPU allocator {info['cpu_allocator']}, "
              f"swap {os.path.join(swap_dir, *run_dirs[:1])}", flush=True)
        samples.append({**sample(tm, 0, swap_dir), "others_cores": None})
        busy0, cpu0 = cpu_busy_seconds(interrupts=False), time.process_time()  # as the inference bench counts
        step = 0
        try:
            for step in range(1, args.steps + 1):
                ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
                t0 = time.perf_counter()
                tm.optimizer.zero_grad()
                loss = model(ids, labels=ids).loss
                tm.backward(loss)
                tm.optimizer.step()
                step_seconds.append(time.perf_counter() - t0)
                losses.append(float(loss.detach()))
                if not math.isfinite(losses[-1]):
                    raise RuntimeError(f"step {step}: the loss is {losses[-1]}")
                if step % args.every == 0 or step == args.steps:
                    s = sample(tm, step, swap_dir)
                    prev = samples[-1]
                    n = step - prev["step"]
                    busy1, cpu1 = cpu_busy_seconds(interrupts=False), time.process_time()
                    wall = s["time"] - prev["time"]
                    s["read_per_step"] = (s["bytes_read_total"] - prev["bytes_read_total"]) / n
                    s["written_per_step"] = (s["bytes_written_total"] - prev["bytes_written_total"]) / n
                    s["step_seconds"] = statistics.fmean(step_seconds[-n:])
                    s["loss"] = statistics.fmean(losses[-n:])
                    s["others_cores"] = (max(0.0, busy1 - busy0 - (cpu1 - cpu0)) / wall
                                         if busy0 is not None and busy1 is not None and wall > 0 else None)
                    busy0, cpu0 = busy1, cpu1
                    samples.append(s)
                    if step % (args.every * args.print_every) == 0 or step == args.steps:
                        print(f"  step {step:>5}: RSS {s['rss'] / 1e6:7.1f} MB, fds {s['fds']}, threads "
                              f"{s['threads_python']}/{s['threads_os']}, host {s['host_now'] / 1e6:.2f} MB, swap "
                              f"{s['swap_size'] / 1e6:.1f} MB ({s['swap_allocated'] / 1e6:.1f} allocated), "
                              f"read/written {s['read_per_step'] / 1e6:.1f}/{s['written_per_step'] / 1e6:.1f} MB per "
                              f"step, {s['step_seconds']:.3f} s/step, loss {s['loss']:.4f}, others "
                              f"{s['others_cores'] if s['others_cores'] is not None else float('nan'):.2f} cores",
                              flush=True)
        except Exception as exc:  # a soak that fails says at which step and why, and still reports what it saw
            failure = {"step": step, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(f"  FAILED at step {step}: {failure['error']}", flush=True)
        steps_wall = time.perf_counter() - t_run
    after = after_state(swap_dir)
    # A thread that has finished in Python (joined) leaves the kernel's task list a moment later, and io-wq
    # workers end on their own once the ring is closed: wait (at most EXIT_SETTLE_S) for the count to settle
    t_exit = time.perf_counter()
    own_before = before["threads_os"] - before["thread_names"].get(IO_WQ_PREFIX, 0)
    while (after["threads_os"] - after["thread_names"].get(IO_WQ_PREFIX, 0) != own_before
           or after["thread_names"].get(IO_WQ_PREFIX, 0)) and time.perf_counter() - t_exit < EXIT_SETTLE_S:
        time.sleep(0.01)
        after = after_state(swap_dir)
    after["settle_seconds"] = time.perf_counter() - t_exit
    # the handle keeps the closed swapper, and through it views of the host pool, whose mapping is then
    # not unmapped at exit (see docs/benchmarks.md); drop it and measure again
    del tm
    gc.collect()
    released = after_state(swap_dir)
    return {"parameters": params, "overrides": overrides, "info": info, "samples": samples,
            "step_seconds": step_seconds, "losses": losses, "before_entry": before, "after_exit": after,
            "after_release": released, "failure": failure, "run_seconds": steps_wall,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# -- output -------------------------------------------------------------------------------------------
def _fmt(v: Any, div: float) -> str:
    if v is None:
        return "–"
    if div == 1 and float(v).is_integer():
        return f"{int(v)}"
    x = v / div
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def print_summary(summary: dict[str, dict[str, Any]], half: int, steps: int) -> None:
    print(f"\nsecond half: the samples after step {half} of {steps}; slope = least-squares fit over them\n")
    head = (f"{'series':<26} {'unit':<4} {'first':>9} {'last':>9} {'2nd-half min':>12} {'2nd-half max':>12} "
            f"{'slope/1000 steps':>16}  flat")
    print(head)
    print("-" * len(head))
    for name, _, unit, div, _ in SERIES:
        r = summary[name]
        slope = r["slope_per_1000_steps"]
        verdict = {True: "yes", False: "NO", None: "–"}[r["flat"]]
        print(f"{r['label']:<26} {unit:<4} {_fmt(r['first'], div):>9} {_fmt(r['last'], div):>9} "
              f"{_fmt(r['second_half_min'], div):>12} {_fmt(r['second_half_max'], div):>12} "
              f"{'–' if slope is None else f'{slope / div:+.4g}':>16}  {verdict}"
              + (f" ({r['limit']})" if r["flat"] is not None else ""))


def plot(path: str, samples: list[dict[str, Any]], losses: list[float], summary: dict[str, dict[str, Any]],
         half: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [  # (title, unit divisor, unit, [(series, label)])
        ("RSS", 1e6, "MB", [("rss", "VmRSS")]),
        ("open descriptors", 1, "count", [("fds", "/proc/self/fd")]),
        ("threads", 1, "count", [("threads_os", "/proc Threads"), ("threads_own", "less io-wq workers"),
                                 ("io_wq_workers", "io_uring io-wq workers"),
                                 ("threads_python", "threading.active_count()")]),
        ("pinned and host bytes", 1e6, "MB", [("host_now", "ledger host now"), ("vm_pin", "VmPin"),
                                              ("pool_pinned", "pool pinned for CUDA")]),
        ("swap files under the swap directory", 1e6, "MB", [("swap_size", "st_size"),
                                                            ("swap_allocated", "st_blocks × 512")]),
        ("tiermem I/O per step", 1e6, "MB", [("read_per_step", "bytes_read"), ("written_per_step", "bytes_written")]),
        ("step time (mean per sample window)", 1, "s", [("step_seconds", "wall time")]),
        ("loss", 1, "", [("loss", "mean per window")]),
    ]
    fig, axes = plt.subplots(4, 2, figsize=(13, 14), sharex=True)
    for ax, (ptitle, div, unit, series) in zip(axes.flat, panels, strict=True):
        if ptitle == "loss":
            ax.plot(range(1, len(losses) + 1), losses, color="0.8", lw=0.5, label="every step")
        for name, label in series:
            pts = [(s["step"], s[name] / div) for s in samples if s.get(name) is not None]
            if not pts:
                continue
            steps, values = zip(*pts, strict=True)
            slope = summary[name]["slope_per_1000_steps"]
            tag = "" if slope is None or name == "loss" else f" (fit {slope / div:+.3g} {unit}/1000 steps)"
            line, = ax.plot(steps, values, marker=".", ms=3, lw=1, label=label + tag)
            late = [(x, y) for x, y in pts if x > half]
            if tag and late:
                xs = [x for x, _ in late]
                mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in late)
                fit = [my + slope / 1000 / div * (x - mx) for x in (xs[0], xs[-1])]
                ax.plot((xs[0], xs[-1]), fit, ls="--", color="black", lw=1)
        if ptitle.startswith("step time"):
            others = [(s["step"], s["others_cores"]) for s in samples if s.get("others_cores") is not None]
            if others:
                ax2 = ax.twinx()
                ax2.plot(*zip(*others, strict=True), color="tab:red", lw=0.8, alpha=0.6)
                ax2.set_ylabel("other processes' CPU (cores)", color="tab:red", fontsize=8)
                ax2.tick_params(axis="y", colors="tab:red", labelsize=8)
                ax2.set_ylim(0, max(2.0, max(v for _, v in others)))
        ax.axvspan(0, half, color="0.93", zorder=0)
        ax.set_title(ptitle, fontsize=10)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
        if ptitle in ("open descriptors", "threads", "swap files under the swap directory", "pinned and host bytes"):
            lo, hi = ax.get_ylim()
            if hi - lo < 1e-9 or (hi - lo) < 0.02 * max(abs(hi), 1):  # a constant: show it as a flat line, not noise
                mid = (hi + lo) / 2
                pad = max(abs(mid) * 0.1, 1)
                ax.set_ylim(mid - pad, mid + pad)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(title + "\n(grey: first half, warm-up; dashed black: least-squares fit over the second half; "
                 "step time: red, other processes' CPU)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


# -- main ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    p.add_argument("--every", type=int, default=20, help="sample every this many steps (default 20)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 100 steps, a sample every 10, and the "
                   f"outputs in {QUICK_JSON} and {QUICK_PLOT} unless --json/--plot say otherwise")
    p.add_argument("--layers", type=int, default=4, help="GPT-2 layers (default 4)")
    p.add_argument("--width", type=int, default=128, help="GPT-2 n_embd (default 128)")
    p.add_argument("--heads", type=int, default=None, help="GPT-2 n_head (default: width / 64)")
    p.add_argument("--vocab", type=int, default=1000, help="vocabulary size (default 1000)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence and n_positions (default 64)")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--host-budget", default="10MiB", help="memory.host_budget (default 10MiB; see docs/benchmarks.md "
                   "for what 8MiB did)")
    p.add_argument("--activations-buffer", default="1MiB", help="activations.buffer, part of the host budget "
                   "(default 1MiB)")
    p.add_argument("--activations-min-bytes", default="16KiB", help="activations.min_bytes (default 16KiB)")
    p.add_argument("--min-unit-bytes", default="256KiB", help="wrap.min_unit_bytes (default 256KiB: each block "
                   "is a unit)")
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"a fresh swap directory is made under this one and removed "
                   f"at the end (default {DEFAULT_DIR})")
    p.add_argument("--print-every", type=int, default=5, help="print a progress line every this many samples "
                   "(default 5)")
    p.add_argument("--json", metavar="OUT.json", default=None,
                   help=f"where to write every figure (default {os.path.relpath(DEFAULT_JSON, ROOT)})")
    p.add_argument("--plot", metavar="OUT.png", default=None,
                   help=f"where to draw the curves (default {os.path.relpath(DEFAULT_PLOT, ROOT)})")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.every = 100, min(args.every, 10)
    args.json = args.json or (QUICK_JSON if args.quick else DEFAULT_JSON)
    args.plot = args.plot or (QUICK_PLOT if args.quick else DEFAULT_PLOT)
    if args.heads is None:
        args.heads = max(1, args.width // 64)
    if min(args.steps, args.every, args.layers, args.batch, args.seq, args.print_every) < 1 or args.width % args.heads:
        p.error("--steps, --every, --layers, --batch, --seq and --print-every must be >= 1, and --width a multiple "
                "of --heads")
    try:
        args.host_budget_bytes = parse_size(args.host_budget, what="--host-budget")
        parse_size(args.activations_buffer, what="--activations-buffer")
        parse_size(args.activations_min_bytes, what="--activations-min-bytes")
        parse_size(args.min_unit_bytes, what="--min-unit-bytes")
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    os.makedirs(args.dir, mode=0o700, exist_ok=True)
    swap_dir = tempfile.mkdtemp(prefix="soak-", dir=args.dir)  # fresh, 0700
    model = model_info(args)
    system = describe_system([swap_dir])
    system["loadavg_start"] = os.getloadavg()
    versions = package_versions("tiermem", "torch", "transformers")
    print_system_header("tiermem soak", system, versions)
    ratio = model["training_state_bytes"] / args.host_budget_bytes
    print(f"  model: GPT2LMHeadModel(n_layer={args.layers}, n_embd={args.width}, n_head={args.heads}, "
          f"vocab_size={args.vocab}, n_positions={args.seq}), dropout 0, fp32; {model['parameters'] / 1e6:.3f}M "
          f"parameters; batch {args.batch}x{args.seq} random tokens; AdamW(fused)")
    print(f"  training state (fp32 params + grads + 2 Adam moments): {model['training_state_bytes'] / 1e6:.1f} MB = "
          f"{ratio:.2f} x the host budget {format_size(args.host_budget_bytes)} (activations.buffer "
          f"{args.activations_buffer} of it)")
    print(f"  {args.steps} steps, a sample every {args.every}; flat judged over the samples after step "
          f"{args.steps // 2}", flush=True)

    half = args.steps // 2
    try:
        out = run(args, swap_dir)
    finally:
        shutil.rmtree(swap_dir, ignore_errors=True)
    summary = summarize(out["samples"], half, args.host_budget_bytes)
    print_summary(summary, half, args.steps)
    before, after = out["before_entry"], out["after_exit"]
    own = {k: d["threads_os"] - d["thread_names"].get(IO_WQ_PREFIX, 0)
           for k, d in (("before", before), ("after", after))}
    exit_ok = {"fds": after["fds"] == before["fds"], "threads_less_io_wq": own["after"] == own["before"],
               "swap_directory_empty": not after["entries_left"]}
    print(f"\nafter exit: fds {after['fds']} (before entry {before['fds']}), threads less io-wq workers "
          f"{own['after']} (before {own['before']}; {after['settle_seconds'] * 1e3:.0f} ms after exit), Python "
          f"threads {after['threads_python']} (before {before['threads_python']}), RSS {after['rss'] / 1e6:.1f} MB "
          f"(before {before['rss'] / 1e6:.1f}), swap "
          "directory " + ("empty" if exit_ok["swap_directory_empty"]
                          else "NOT empty: " + ", ".join(after["entries_left"])))
    released = out["after_release"]
    print(f"after dropping the handle (del tm; gc.collect()): RSS {released['rss'] / 1e6:.1f} MB, fds "
          f"{released['fds']}, threads {released['threads_os']}")
    late = [t for i, t in enumerate(out["step_seconds"], 1) if i > half]
    late_time = {"mean": statistics.fmean(late), "std": statistics.pstdev(late)} if late else None
    others = [s["others_cores"] for s in out["samples"] if s.get("others_cores") is not None]
    judged = [r["flat"] for r in summary.values() if r["flat"] is not None and r["criterion"] != "hint"]
    failure = out["failure"]
    system["loadavg_end"] = os.getloadavg()
    wall = time.perf_counter() - t_start
    if args.quick:
        print("(--quick: the second half is too short for its slopes to mean much; this checks that the script runs)")
    if failure:
        print(f"\nFAILED at step {failure['step']} of {args.steps}: {failure['error']}")
    print((f"second-half step time {late_time['mean']:.3f} ± {late_time['std']:.3f} s; " if late_time else "")
          + (f"other processes {statistics.fmean(others):.2f} cores on average (max {max(others):.2f} in a window); "
             if others else "")
          + f"{sum(judged)} of {len(judged)} judged series flat; steps took {out['run_seconds']:.0f} s, "
          f"whole run {wall:.0f} s")

    title = (f"tiermem soak: GPT-2 {args.layers}x{args.width}, {args.steps} steps, host budget {args.host_budget}, "
             f"every tier but grads on NVMe (tiermem {(system['tiermem_tree']['commit'] or '?')[:7]})"
             + (f"; FAILED at step {failure['step']}" if failure else ""))
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    plot(args.plot, out["samples"], out["losses"], summary, half, title)
    report = {
        "command": " ".join(["python3", "bench/soak.py", *argv]),
        "system": system,
        "versions": versions,
        "model": {**model, "training_state_to_host_budget": ratio},
        "config": {"steps": args.steps, "every": args.every, "second_half_after_step": half,
                   "host_budget": args.host_budget, "host_budget_bytes": args.host_budget_bytes,
                   "adamw": {**ADAMW, "betas": list(ADAMW["betas"])}, "seed": SEED, "input_seed": INPUT_SEED,
                   "tiermem_overrides": out["overrides"], "swap_dir": swap_dir,
                   "thresholds": {"rss_bytes_per_1000_steps": RSS_SLOPE_LIMIT,
                                  "host_now_bytes_per_1000_steps": HOST_SLOPE_LIMIT,
                                  "io_fraction_of_mean_per_1000_steps": RELATIVE_LIMIT,
                                  "step_time_fraction_of_mean_per_1000_steps": STEP_TIME_LIMIT,
                                  "constant": "fds, threads, pinned bytes, swap sizes and file count: one value over "
                                              "the second half"},
                   "units": "bytes; MB = 1e6 bytes; slopes per 1000 steps"},
        "tiermem": out["info"],
        "summary": summary,
        "all_judged_flat": all(judged),
        "before_entry": before,
        "after_exit": {**after, "checks": exit_ok},
        "after_release": out["after_release"],
        "failure": failure,
        "second_half_step_seconds": late_time,
        "others_cores_mean": statistics.fmean(others) if others else None,
        "peak_rss_bytes": out["peak_rss_bytes"],
        "samples": out["samples"],
        "step_seconds": out["step_seconds"],
        "losses": out["losses"],
        "run_seconds": out["run_seconds"],
        "wall_seconds": wall,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_json(args.json, report)
    return 0 if not failure and all(judged) and all(exit_ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
