"""`tiermem tune --path DIR [--model config.json]`: search the I/O settings (and, for a model, the prefetch depth
and host-budget split) under a time limit, print them ranked and write a swap-config (see [Note: tuning] in
tiermem/tune.py)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from tiermem.cli.bench import make_writable_dirs
from tiermem.cli.config_cmd import _parse_set
from tiermem.cli.plan import OPTIMIZER_CHOICES
from tiermem.cli.progress import ProgressBar
from tiermem.errors import BenchArgError, ConfigError
from tiermem.io.backends import BACKENDS
from tiermem.io.buffers import check_io_size
from tiermem.sizes import format_size, parse_size, short_repr

_UNITS = {"s": 1, "m": 60, "h": 3600}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="find the fastest I/O settings (and prefetch depth for a model); write a config",
                       description="Measure engine x block size x queue depth (x SQPOLL) on the swap directories, "
                       "coarse to fine within --time-limit; with --model, plan prefetch.depth and the host budget's "
                       "split; print the settings ranked and write them as a swap-config.")
    p.add_argument("--path", action="append", required=True, metavar="DIR",
                   help="swap directory (repeatable: striped across them, as nvme.paths)")
    p.add_argument("--model", metavar="config.json", default=None,
                   help="a transformers model config: also choose prefetch.depth and the host budget's split")
    p.add_argument("--time-limit", default="5m", help="wall-clock bound of the search, e.g. 90s, 5m (default 5m)")
    p.add_argument("--size", default="256MiB", help="bytes written and read per measurement (default 256MiB)")
    p.add_argument("--engine", default="all", choices=["all", *BACKENDS], help="engine(s) to search")
    p.add_argument("--block-size", default=None, metavar="LIST",
                   help="block sizes to search, commas (default 128KiB to 8MiB, doubling)")
    p.add_argument("--queue-depth", default=None, metavar="LIST",
                   help="queue depths to search, commas (default 1 to 128, doubling)")
    p.add_argument("--sqpoll", choices=["auto", "on", "off"], default="auto",
                   help="io_uring SQPOLL: search with and without it where it works here (auto), only with, only "
                   "without")
    p.add_argument("--direct", action=argparse.BooleanOptionalAction, default=True,
                   help="O_DIRECT (default), as io.direct")
    p.add_argument("--config", default=None, metavar="FILE", help="swap-config to start from (default: defaults)")
    p.add_argument("--set", action="append", type=_parse_set, metavar="KEY=VALUE",
                   help="override one key of the starting config, e.g. --set memory.host_budget=8GiB")
    p.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default=None,
                   help="with --model: plan training with this optimizer (default: inference)")
    p.add_argument("--batch", default=None, metavar="BxT", help="with --model: batch x sequence length, e.g. 2x128")
    p.add_argument("--out", default="tiermem.yaml", metavar="FILE", help="the swap-config to write (tiermem.yaml)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def parse_duration(text: str, option: str = "--time-limit") -> float:
    """`90s`, `5m`, `1.5h` or plain seconds, as seconds; BenchArgError naming `option` otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", str(text).lower())
    if not m or float(m.group(1)) <= 0:
        raise BenchArgError(f"{option}: expected a positive duration such as 90s or 5m, got {short_repr(text)}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _sizes(option: str, text: str) -> list[int]:
    try:
        sizes = [parse_size(b.strip(), what=option) for b in text.split(",")]
    except ValueError as exc:
        raise BenchArgError(str(exc)) from None
    for b in sizes:
        check_io_size(option, b, BenchArgError)
    return sizes


def _depths(text: str) -> list[int]:
    try:
        depths = [int(q) for q in text.split(",")]
    except ValueError:
        depths = []
    if not depths or any(q < 1 or q > 4096 for q in depths):
        raise BenchArgError(f"--queue-depth: expected integers from 1 to 4096, got {short_repr(text)}")
    return depths


def run(args: argparse.Namespace) -> int:
    from tiermem import tune
    from tiermem.config import format_config, load_config

    limit = parse_duration(args.time_limit)
    size = _sizes("--size", args.size)[0]
    block_sizes = _sizes("--block-size", args.block_size) if args.block_size else tune.BLOCK_SIZES
    depths = _depths(args.queue_depth) if args.queue_depth else tune.QUEUE_DEPTHS
    make_writable_dirs(args.path)
    base = dict(args.set or [])
    load_config(args.config, **base)  # a bad starting config fails before minutes of measuring
    model = None
    if args.model:
        from tiermem.cli.plan import build_model, parse_batch

        model, batch = build_model(args.model), parse_batch(args.batch)
    variants = tune.engine_variants(None if args.engine == "all" else [args.engine],
                                    {"auto": None, "on": True, "off": False}[args.sqpoll])
    if not variants:
        raise BenchArgError(f"--engine {args.engine}: not usable here; see tiermem info")

    started = time.monotonic()
    io_limit = limit * (0.85 if model is not None else 1.0)  # the plans need the rest
    rows: list[dict[str, Any]] = []
    bar = None if args.no_progress or args.json else ProgressBar()
    try:
        ranked = tune.search(variants, block_sizes, depths, tune.bench_measure(args.path, size, direct=args.direct,
                                                                               results=rows),
                             time_limit=io_limit, progress=bar)
    finally:
        if bar:
            bar.close()
    cached = tune.cache_results(args.path, rows)  # tiermem plan (and the model's plans below) read them
    if cached and not args.json:
        print(f"figures cached in {cached} (tiermem plan reads them)", file=sys.stderr)
    pick = ranked[0]
    keys: dict[str, Any] = {**base, "nvme.paths": list(args.path), **pick.setting.to_config(),
                            "io.direct": args.direct}
    if len(args.path) > 1:
        keys["nvme.stripe_size"] = pick.setting.block_size  # as measured: one request per drive
    choice = None
    if model is not None:
        left = max(0.0, limit - (time.monotonic() - started))
        choice = tune.choose_for_model(model, args.config, keys, optimizer=args.optimizer, batch=batch,
                                       time_limit=left)
        keys.update(choice.overrides)
    try:
        cfg = load_config(args.config, **keys)
    except ConfigError as exc:
        raise ConfigError(f"the tuned settings do not make a valid config: {exc}") from None
    text = format_config(cfg)
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise BenchArgError(f"--out {args.out}: cannot write it ({exc.strerror}); pass a writable path") from None
    elapsed = time.monotonic() - started
    if args.json:
        print(json.dumps({"measured": [m.to_dict() for m in ranked], "pick": pick.to_dict(),
                          "model": None if choice is None else {"overrides": choice.overrides,
                                                                "step_seconds_min": choice.step_seconds_min,
                                                                "candidates": choice.candidates},
                          "config": cfg.to_dict(), "out": args.out, "elapsed_seconds": elapsed,
                          "time_limit_seconds": limit, "size": size}, indent=2))
        return 0
    print_table(ranked)
    s = pick.setting
    print(f"pick: {s.engine}{' with SQPOLL' if s.sqpoll else ''}, io.block_size {format_size(s.block_size)}, "
          f"io.queue_depth {s.queue_depth}: read {pick.read_gbps:.2f} GB/s, write {pick.write_gbps:.2f} GB/s "
          f"({len(ranked)} settings measured in {elapsed:.0f} s of {limit:.0f} s)")
    if choice is not None:
        bound = "unknown" if choice.step_seconds_min is None else f"{choice.step_seconds_min:.4g} s"
        print("model: " + ", ".join(f"{k} {v}" for k, v in choice.overrides.items())
              + f" (step time >= {bound}; {len(choice.candidates)} plans weighed)")
    print(f"written to {args.out} (tiermem config check {args.out})")
    return 0


def print_table(ranked: list[Any], top: int = 12) -> None:
    head = f"{'rank':>4}  {'engine':<15} {'block':>7} {'qd':>4} {'read GB/s':>10} {'write GB/s':>10} {'score':>7} runs"
    print(head)
    print("-" * len(head))
    for k, m in enumerate(ranked[:top], 1):
        s = m.setting
        engine = f"{s.engine}{'+sqpoll' if s.sqpoll else ''}"
        print(f"{k:>4}  {engine:<15} {format_size(s.block_size):>7} {s.queue_depth:>4} {m.read_gbps:>10.2f} "
              f"{m.write_gbps:>10.2f} {m.score:>7.2f} {len(m.read):>4}")
    if len(ranked) > top:
        print(f"      ... {len(ranked) - top} more (--json lists them all)")
