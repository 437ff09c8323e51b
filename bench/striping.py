#!/usr/bin/env python3
"""Two drives striped: does tiermem read at the sum of their bandwidths? (issue 16's second goal)

The two "drives" are the machine's disk (--disk) and a second one (--second); without --second, an ext4
filesystem on a loop device backed by RAM is made for the run (bench/ramdrive.sh, root) and removed after.
Each round measures, side by side, with `tiermem bench io --mode read --engine io_uring` (1 GiB, 3 runs):

- each drive alone (which also caches its figure, so `nvme.path_weights: auto` can weigh them),
- both striped with equal chunks (`--weights 1`), the layout before weights: the fast drive is held to the
  slow one's speed, so it reads at about twice the slow drive,
- both striped with the weights `auto` derives from the figures just measured,

and then an I/O-bound forward (bench/io_bound_forward.py's 24 blocks of 33.6 MB under 256 MiB) whose
swap space is striped over both drives with `auto`. The goal: striped reads within 10% of the sum of the
two drives alone, measured in the same round. The bench keeps its figures in a cache of its own
(XDG_CACHE_HOME in a temporary directory), not the user's.

    python3 bench/striping.py --rounds 3 --json bench/results/striping.json
    python3 bench/striping.py --rounds 3 --second-read-rate 4GB --json bench/results/striping_throttled.json

# [Note: a second drive of a set speed]
The RAM-backed loop drive is no drive: it reads as fast as the loop driver copies memory, 4-11 GB/s from
one round to the next on this machine, on the same two cores that complete the disk's reads and run the
bench. `--second-read-rate` caps its reads with the kernel's block throttle (a blkio cgroup, v1
`blkio.throttle.read_bps_device` or v2 `io.max`, on the second drive's block device only) and runs the
whole bench inside that cgroup, so the second drive reads at a set speed, as a real drive does, and the
loop driver's copying takes only that much of the CPU. The disk is not throttled.

# [Note: each drive at its best]
Striped at queue depth 32, each drive has only its share of the 32 requests in flight. This machine's
virtio disk reads faster at 16 than at 32 (3.25 against 2.37 GB/s in one sweep), so a sum of the drives
alone at 32 understates what they give together: equal chunks then read above that sum. Each drive alone
is therefore measured at depths 8, 16 and 32 (a quarter, half and all of `--queue-depth`) and its best is
the figure the sum adds and `auto` weighs by.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    describe_system,
    disk_rate_capped,
    package_versions,
    print_system_header,
    rotated,
    run_worker,
    tiermem_bench_io,
    write_json,
)

from tiermem.sizes import parse_size  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FORWARD_TAG = "IO_BOUND_RESULT "  # bench/io_bound_forward.py's worker


def read_gbps(paths: list[str], weights: str, env: dict[str, str], queue_depths: str) -> float:
    """Mean read GB/s of `tiermem bench io` on `paths` striped by `weights`: the best of `queue_depths`
    (commas for several; the cache, which `auto` weighs by, keeps the best too)."""
    extra = [a for p in paths[1:] for a in ("--path", p)]
    options = ["--engine", "io_uring", "--mode", "read", "--size", "1GiB", "--runs", "3",
               "--queue-depth", queue_depths, "--weights", weights, *extra]
    results, _ = tiermem_bench_io(options, paths[0], timeout=900, env=env)
    return max(float(r["gbps_mean"]) for r in results)


def one_round(rnd: int, disk: str, second: str, env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    a, b = os.path.join(disk, "io"), os.path.join(second, "io")
    out: dict[str, Any] = {}
    # the drives alone first: `auto` needs both figures; the two striped runs then in rotated order. Each
    # drive alone is taken at its best depth up to the striped runs' (see [Note: each drive at its best])
    alone = ",".join(str(d) for d in sorted({max(1, args.queue_depth // 4), max(1, args.queue_depth // 2),
                                              args.queue_depth}))
    out["disk_alone"] = read_gbps([a], "1", env, alone)
    out["second_alone"] = read_gbps([b], "1", env, alone)
    for kind in rotated(["equal", "auto"], rnd):
        out[f"striped_{kind}"] = read_gbps([a, b], "1" if kind == "equal" else "auto", env, str(args.queue_depth))
    with tempfile.TemporaryDirectory(dir=disk) as da, tempfile.TemporaryDirectory(dir=second) as db:
        spec = {"dir": da, "host_budget": args.host_budget, "queue_depth": args.queue_depth,
                "forwards": args.forwards, "swap_paths": [os.path.join(da, "swap"), os.path.join(db, "swap")],
                "skip_engine": True}
        fwd = run_worker(os.path.join(HERE, "io_bound_forward.py"), "_worker", spec, tag=FORWARD_TAG, timeout=900,
                         env=env, name="forward")
    out["forward"] = statistics.mean(fwd["read_gbps"])
    out["forward_weights"] = fwd["weights"]
    out["forward_disk_idle_share"] = fwd["disk_idle_seconds"] / fwd["pass_seconds"]
    total = out["disk_alone"] + out["second_alone"]
    out["sum_alone"] = total
    for k in ("striped_equal", "striped_auto", "forward"):
        out[f"{k}_of_sum"] = out[k] / total
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--disk", default="/var/tmp/tiermem-striping", help="a directory on the machine's disk")
    p.add_argument("--second", help="a directory on a second drive (default: a RAM-backed loop drive, root)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--forwards", type=int, default=5)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--host-budget", default="256MiB")
    p.add_argument("--second-read-rate", help="cap the second drive's reads at this many bytes a second, "
                   "e.g. 4GB (root; see [Note: a second drive of a set speed])")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.forwards < 1:
        p.error(f"--forwards {args.forwards}: each round times the striped forward at least once; give 1 or more")
    made = args.second is None
    if made:
        mount = subprocess.run(["bash", os.path.join(HERE, "ramdrive.sh"), "up"], capture_output=True, text=True,
                               check=True).stdout.strip().splitlines()[-1]
        args.second = os.path.join(mount, "tiermem")
    try:
        for d in (args.disk, args.second):
            os.makedirs(d, exist_ok=True)
        system = describe_system([args.disk, args.second])
        print_system_header("striping: two drives", system, package_versions("torch"))
        rounds = []
        with contextlib.ExitStack() as stack:
            if args.second_read_rate:
                rate = parse_size(args.second_read_rate)
                device = stack.enter_context(disk_rate_capped(args.second, read=rate))
                print(f"second drive ({device}) reads capped at {rate / 1e9:.2f} GB/s", flush=True)
            cache = stack.enter_context(tempfile.TemporaryDirectory())
            env = {**os.environ, "XDG_CACHE_HOME": cache}
            for rnd in range(args.rounds):
                r = one_round(rnd, args.disk, args.second, env, args)
                rounds.append(r)
                print(f"round {rnd}: disk {r['disk_alone']:.2f} + second {r['second_alone']:.2f} = "
                      f"{r['sum_alone']:.2f} GB/s; striped equal {r['striped_equal']:.2f} "
                      f"({r['striped_equal_of_sum']:.0%}), weighted {r['striped_auto']:.2f} "
                      f"({r['striped_auto_of_sum']:.0%}); forward {r['forward']:.2f} "
                      f"({r['forward_of_sum']:.0%}, weights {':'.join(map(str, r['forward_weights']))}, "
                      f"disk idle {r['forward_disk_idle_share']:.0%})", flush=True)
        summary = {k: statistics.median(r[k] for r in rounds)
                   for k in ("striped_equal_of_sum", "striped_auto_of_sum", "forward_of_sum")}
        print("medians of the share of the sum: " + ", ".join(f"{k} {v:.0%}" for k, v in summary.items()))
        if args.json:
            write_json(args.json, {"system": system, "args": vars(args), "rounds": rounds, "medians": summary})
    finally:
        if made:
            subprocess.run(["bash", os.path.join(HERE, "ramdrive.sh"), "down"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
