"""`tiermem bench io`: measure a disk's sequential bandwidth through tiermem's own engines."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tiermem.cli.progress import ProgressBar
from tiermem.errors import BenchArgError
from tiermem.io.backends import BACKENDS, available_backends
from tiermem.io.bandwidth import BenchSpec, path_weights, run_benchmark, save_bench_results, system_info
from tiermem.io.buffers import check_io_size
from tiermem.sizes import format_size, parse_size, short_repr

DEFAULT_PATH = "/var/tmp/tiermem"
SWEEP_BLOCK_SIZES = ["128KiB", "512KiB", "1MiB", "4MiB"]
SWEEP_QUEUE_DEPTHS = [1, 8, 32]


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bsub.required = True
    p = bsub.add_parser("io", help="sequential read/write bandwidth of swap directories through the engines",
                        description="Measure GB/s (1 GB = 1e9 bytes) and CPU-seconds per GiB of sequential "
                        "reads and writes. Reads bypass the page cache (O_DIRECT, or dropped and said so).")
    p.add_argument("--path", action="append", default=None,
                   help=f"directory to test (repeatable: striped across them); default {DEFAULT_PATH}")
    p.add_argument("--size", default="1GiB", help="bytes per run, e.g. 512MiB, 2GiB (default 1GiB)")
    p.add_argument("--block-size", default=None, help="request size, e.g. 1MiB (repeatable with commas)")
    p.add_argument("--queue-depth", default=None, help="requests in flight (commas for several)")
    p.add_argument("--engine", default="all", choices=["all", "auto", *BACKENDS], help="engine(s) to measure")
    p.add_argument("--mode", default="both", choices=["read", "write", "both"])
    p.add_argument("--runs", type=int, default=3, help="repetitions per measurement (mean ± stdev)")
    p.add_argument("--direct", action=argparse.BooleanOptionalAction, default=True,
                   help="O_DIRECT (default); --no-direct uses the page cache and drops it before reads")
    p.add_argument("--sweep", action="store_true",
                   help=f"block sizes {','.join(SWEEP_BLOCK_SIZES)} x queue depths "
                   f"{','.join(map(str, SWEEP_QUEUE_DEPTHS))}")
    p.add_argument("--stripe-size", default=None, help="stripe chunk across several --path (default: block size)")
    p.add_argument("--weights", default="1", metavar="W1,W2,...|auto",
                   help="stripe chunks per directory across several --path, as nvme.path_weights (e.g. 1,3); "
                   "auto weighs them by their cached read GB/s (default: equal)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="save a bar chart of GB/s")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run_io)


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    """Validate the options into a BenchSpec; raise BenchArgError naming the option and the fix."""
    size = _size("--size", args.size)
    if size <= 0:
        raise BenchArgError("--size: expected a positive size such as 256MiB")
    if args.sweep and (args.block_size or args.queue_depth):
        raise BenchArgError("--sweep chooses block sizes and queue depths itself; drop --block-size/--queue-depth")
    block_sizes = [_size("--block-size", b) for b in (SWEEP_BLOCK_SIZES if args.sweep else
                                                       (args.block_size or "1MiB").split(","))]
    for b in block_sizes:
        check_io_size("--block-size", b, BenchArgError)
    try:
        depths = SWEEP_QUEUE_DEPTHS if args.sweep else [int(q) for q in (args.queue_depth or "32").split(",")]
    except ValueError:
        raise BenchArgError(f"--queue-depth: expected integers >= 1, got {short_repr(args.queue_depth)}") from None
    if any(q < 1 or q > 4096 for q in depths):
        raise BenchArgError(f"--queue-depth: expected integers from 1 to 4096, got {short_repr(args.queue_depth)}")
    if args.runs < 1:
        raise BenchArgError(f"--runs: expected an integer >= 1, got {args.runs}")
    usable = [n for n, reason in available_backends().items() if reason is None]
    if args.engine == "all":
        engines = usable
    elif args.engine == "auto":
        engines = ["io_uring" if "io_uring" in usable else "threads"]
    else:
        engines = [args.engine]
    modes = ["write", "read"] if args.mode == "both" else [args.mode]
    stripe = _size("--stripe-size", args.stripe_size) if args.stripe_size else None
    paths = args.path or [DEFAULT_PATH]
    make_writable_dirs(paths)
    return BenchSpec(paths=paths, size=size, block_sizes=block_sizes, queue_depths=depths,
                     engines=engines, modes=modes, runs=args.runs, direct=args.direct, stripe_size=stripe,
                     weights=_weights(args.weights, paths))


def _weights(text: str, paths: list[str]) -> tuple[int, ...]:
    """--weights: "auto" (as nvme.path_weights: auto), one integer for all, or one per --path."""
    if text == "auto":
        return path_weights(paths, "auto")[0]
    try:
        weights = [int(w) for w in text.split(",")]
    except ValueError:
        raise BenchArgError(f"--weights: expected integers such as 1,3 or auto, got {short_repr(text)}") from None
    if len(weights) == 1:
        weights *= len(paths)
    if len(weights) != len(paths) or any(w < 1 or w > 64 for w in weights):
        raise BenchArgError(f"--weights: expected one integer from 1 to 64 per --path ({len(paths)}), got "
                            f"{short_repr(text)}")
    return tuple(weights)


def run_io(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    system = system_info(spec.paths)
    if not args.json:
        print_header(system, spec)
    bar = None if args.no_progress else ProgressBar()
    try:
        results = run_benchmark(spec, progress=bar)
    finally:
        if bar:
            bar.close()
    cached = save_bench_results(spec.paths, results)  # for `tiermem plan` (see [Note: bench cache])
    if cached and not args.json:
        print(f"figures cached in {cached} (tiermem plan reads them)", file=sys.stderr)
    if args.json:
        print(json.dumps({"system": system, "results": results}, indent=2))
    else:
        print_table(results)
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def print_header(system: dict[str, Any], spec: BenchSpec) -> None:
    print(f"tiermem bench io  |  Linux {system['kernel']} {system['machine']}, {system['cpus']} CPUs, "
          f"THP {system['transparent_hugepage']}")
    for p in system["paths"]:
        print(f"  {p['path']}: {p['filesystem']}, device {p['device'] or '?'} ({p['model'] or 'unknown model'})")
    engines = ", ".join(f"{k}: {v}" for k, v in system["engines"].items())
    print(f"  engines: {engines}")
    print(f"  {format_size(spec.size)} per run, {spec.runs} runs, "
          f"{'O_DIRECT' if spec.direct else 'buffered (page cache dropped before reads)'}")


def print_table(results: list[dict[str, Any]]) -> None:
    head = f"{'engine':<9} {'mode':<5} {'block':>8} {'qd':>4} {'GB/s':>15} {'CPU s/GiB':>10} {'dev req':>9}  direct"
    print(head)
    print("-" * len(head))
    for r in results:
        req = f"{r['avg_request_kib']:.0f}KiB" if r["avg_request_kib"] else "?"
        gbps = f"{r['gbps_mean']:.2f} ± {r['gbps_std']:.2f}"
        print(f"{r['engine']:<9} {r['mode']:<5} {format_size(r['block_size']):>8} {r['queue_depth']:>4} "
              f"{gbps:>15} {r['cpu_seconds_per_gib']:>10.3f} {req:>9}  "
              f"{'yes' if r['direct'] else 'no (cache dropped)'}")


def plot(results: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchArgError("--plot needs matplotlib: pip install 'tiermem[plot]'") from None
    labels = [f"{r['engine']}\n{r['mode']} {format_size(r['block_size'])}\nqd{r['queue_depth']}" for r in results]
    fig, ax = plt.subplots(figsize=(max(6, len(results) * 0.9), 4))
    ax.bar(range(len(results)), [r["gbps_mean"] for r in results], yerr=[r["gbps_std"] for r in results],
           color=["tab:blue" if r["mode"] == "read" else "tab:orange" for r in results])
    ax.set_xticks(range(len(results)), labels, fontsize=7)
    ax.set_ylabel("GB/s (1e9 bytes/s)")
    ax.set_title("tiermem bench io")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _size(option: str, value: str) -> int:
    """`value` in bytes; a bad one (garbage, inf, past 2**63 - 1 bytes) is a BenchArgError naming `option`."""
    try:
        return parse_size(value, what=option)
    except ValueError as exc:
        raise BenchArgError(str(exc)) from None


def make_writable_dirs(paths: list[str]) -> None:
    """Create each --path directory; one that cannot be created or written is a BenchArgError naming it."""
    for path in paths:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise BenchArgError(f"--path {path}: cannot create the directory ({exc.strerror}); "
                                "choose a writable directory") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise BenchArgError(f"--path {path}: not writable by this user; choose a writable directory")
