#!/usr/bin/env python3
"""An I/O-bound forward from NVMe: how close its reads come to the engine's own sequential read bandwidth,
and where the disk idles (issue 16's first goal).

The model is 24 blocks of Linear(2896, 2896) + ReLU, 33.6 MB each in fp32 (805 MB in all), under a
--host-budget of 256 MiB, with tiermem's defaults otherwise (io_uring, prefetch.depth 2, keep_resident):
a forward of one row computes in milliseconds, so its time is the disk's. After two untimed passes (the
first records the order) --forwards passes are timed; each one's bytes_read over its time is the read rate.
In the same run, `tiermem bench io --mode read` on the same folder measures the engine (1 GiB, 3 runs, the
same --queue-depth). Then one more pass is traced (`tm.trace`), and the disk's idle time is read off the
trace: the time within the pass during which no read was in flight.

    python3 bench/io_bound_forward.py --json bench/results/io_bound_forward.json

`--repeat N` runs the whole measurement N times in fresh processes and reports each; `--tiermem DIR` runs
it against the tiermem tree in DIR (a worktree of another commit), for before/after comparisons.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import run_worker, worker_main, write_json  # noqa: E402

TAG = "IO_BOUND_RESULT "
WIDTH, BLOCKS = 2896, 24


def disk_idle(trace_path: str) -> dict[str, float]:
    """Seconds of the traced pass, and of it the seconds with no read in flight (from the trace's spans)."""
    with open(trace_path, encoding="utf-8") as f:
        t = json.load(f)
    events = t["traceEvents"] if isinstance(t, dict) else t
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    reading = {tid for tid, name in names.items() if name.startswith(("read", "nvme read"))}  # old traces: one track
    reads = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] in reading)
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in spans if names.get(e["tid"], "") == "compute"]
    t0, t1 = min(a for a, _ in reads + compute), max(b for _, b in reads + compute)
    idle, cur = 0.0, t0
    for a, b in reads:
        idle += max(0.0, a - cur)
        cur = max(cur, b)
    idle += max(0.0, t1 - cur)
    return {"pass_seconds": (t1 - t0) / 1e6, "disk_idle_seconds": idle / 1e6}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tiermem

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())
                                  for _ in range(BLOCKS)])
    x = torch.randn(1, WIDTH)
    swap_paths = spec.get("swap_paths") or [os.path.join(spec["dir"], "swap")]  # several: bench/striping.py
    settings = {"device": "cpu", "params.tier": "nvme", "nvme.paths": swap_paths,
                "memory.host_budget": spec["host_budget"], "io.engine": "io_uring",
                "io.queue_depth": spec["queue_depth"]}
    rates, seconds = [], []
    with tiermem.tiered_offload(model, **settings) as tm, torch.inference_mode():
        model(x)
        model(x)
        for _ in range(spec["forwards"]):
            tm.reset_stats()
            t0 = time.perf_counter()
            model(x)
            dt = time.perf_counter() - t0
            seconds.append(dt)
            rates.append(tm.stats()["bytes_read"] / dt / 1e9)
        resident = tm.stats()["resident_bytes"]
        store = tm.swapper.store
        weights = list(store.layout.weights) if hasattr(store, "layout") else [1]  # older trees: equal
        trace = os.path.join(spec["dir"], "pass.json")
        with tm.trace(trace):
            model(x)
    if spec.get("skip_engine"):
        engine = None
    else:
        io_paths = [a for p in (spec.get("io_paths") or [os.path.join(spec["dir"], "io")]) for a in ("--path", p)]
        out = subprocess.run([sys.executable, "-m", "tiermem", "bench", "io", "--engine", "io_uring", "--mode",
                              "read", "--size", "1GiB", "--runs", "3", "--queue-depth", str(spec["queue_depth"]),
                              *(["--weights", ",".join(map(str, weights))] if len(weights) > 1 else []),
                              "--json", "--no-progress", *io_paths],
                             capture_output=True, text=True, check=True, env=os.environ).stdout
        engine = json.loads(out)["results"][0]["gbps_mean"]
    return {"read_gbps": rates, "seconds": seconds, "engine_read_gbps": engine, "resident_bytes": resident,
            "weights": weights, **disk_idle(trace), "tiermem": tiermem.__file__}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--forwards", type=int, default=5)
    p.add_argument("--repeat", type=int, default=1, help="whole measurements, each in a fresh process")
    p.add_argument("--host-budget", default="256MiB")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--dir", default="/var/tmp/tiermem-io-bound")
    p.add_argument("--tiermem", help="run against the tiermem package in this tree (another commit's worktree)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    env = dict(os.environ)
    if args.tiermem:
        env["PYTHONPATH"] = os.path.abspath(args.tiermem) + os.pathsep + env.get("PYTHONPATH", "")
    os.makedirs(args.dir, exist_ok=True)
    runs = []
    for k in range(args.repeat):
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            spec = {"dir": d, "host_budget": args.host_budget, "queue_depth": args.queue_depth,
                    "forwards": args.forwards}
            r = run_worker(__file__, "_worker", spec, tag=TAG, timeout=900, env=env)
        fwd = statistics.mean(r["read_gbps"])
        r["ratio"] = fwd / r["engine_read_gbps"]
        runs.append(r)
        print(f"run {k}: forward reads {fwd:.2f} GB/s ({' '.join(f'{x:.2f}' for x in r['read_gbps'])}), engine "
              f"{r['engine_read_gbps']:.2f} GB/s, ratio {r['ratio']:.2f}; traced pass {r['pass_seconds'] * 1e3:.0f} "
              f"ms, disk idle {r['disk_idle_seconds'] * 1e3:.0f} ms "
              f"({r['disk_idle_seconds'] / r['pass_seconds']:.0%}); tiermem {r['tiermem']}", flush=True)
    ratios = [r["ratio"] for r in runs]
    idle = [r["disk_idle_seconds"] / r["pass_seconds"] for r in runs]
    print(f"ratio to the engine: median {statistics.median(ratios):.2f} of {len(runs)}; disk idle median "
          f"{statistics.median(idle):.0%}")
    if args.json:
        write_json(args.json, {"args": vars(args), "runs": runs, "ratio_median": statistics.median(ratios),
                               "idle_share_median": statistics.median(idle)})
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        sys.exit(worker_main(TAG, worker, sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
