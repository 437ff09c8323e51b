"""`tiermem report TRACE`: what a timeline trace (trace.path, tm.trace()) says, and what to change."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tiermem.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="summarize a timeline trace: compute, waits, I/O overlap, what to change")
    p.add_argument("trace", help="a trace written by trace.path or tm.trace(path)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="also draw the timeline and the waits per unit into this PNG "
                   "(needs matplotlib: pip install 'tiermem[plot]')")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tiermem.trace import load_trace, plot, summarize

    try:
        trace = load_trace(args.trace)
        s = summarize(trace)
    except OSError as exc:
        raise ConfigError(f"{args.trace}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{args.trace}: cannot read it as a tiermem trace: {' '.join(str(exc).split())}") from None
    if args.plot:
        try:
            plot(trace, args.plot)
        except ImportError as exc:
            raise ConfigError(f"--plot: drawing needs matplotlib ({exc}); pip install 'tiermem[plot]', or leave "
                              "--plot out") from exc
        except OSError as exc:
            raise ConfigError(f"--plot {args.plot}: cannot write it ({exc.strerror or exc}); pass a writable path "
                              "ending in .png") from exc
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    wall = s["wall_seconds"]
    print(f"{args.trace}: {wall:.3f} s recorded")
    for key, what in (("compute_seconds", "computing (forward and backward)"), ("update_seconds", "updating"),
                      ("wait_seconds", "waiting for units or their state"),
                      ("io_busy_seconds", "with transfers in flight")):
        print(f"  {what:<36} {s[key]:8.3f} s  {s[key] / wall:6.1%}" if wall else f"  {what}: {s[key]:.3f} s")
    if s["io_overlapped_with_compute"] is not None:
        print(f"  I/O that ran while computing or updating: {s['io_overlapped_with_compute']:.1%}")
    if s["copy_seconds"]:
        print(f"  copying between host and device: {s['copy_seconds']:.3f} s")
    bandwidth = s["bandwidth"]
    for key in ("read", "write"):
        print(f"  {key}: {_rate(bandwidth[key])}")
        rows = [r for r in bandwidth["by_path"] if r["op"] == key]
        if len(rows) > 1 or (rows and rows[0]["paths"] != bandwidth[key]["paths"]):
            for r in rows:
                print(f"    {', '.join(r['paths']) or r['track']}: {_rate(r)}")
    passes = s["passes"]
    if passes is not None:
        first, rest = passes["first"], passes["rest"]
        print(f"  passes: {passes['count']}; the first {first['seconds']:.3f} s, {_moved(first)}")
        if rest is not None:
            print(f"    the other {rest['count']}, median: {rest['seconds']:.3f} s each ({rest['seconds_min']:.3f}-"
                  f"{rest['seconds_max']:.3f}), {_moved(rest)}")
    if s["waits_by_unit"]:
        print("  waited longest for: " + ", ".join(f"{k} {v:.3f} s" for k, v in s["waits_by_unit"].items()))
    if s["wait_reasons"]:
        print("  why compute waited:")
        for r in s["wait_reasons"]:
            print(f"    {r['seconds']:8.3f} s {r['share']:6.1%}  {r['waits']:>5} waits  {r['what']}")
    for line in s["advice"]:
        print(f"advice: {line}")
    if args.plot:
        print(f"drawn into {args.plot}")
    return 0


def _moved(row: dict[str, Any]) -> str:
    """A pass's (or the median pass's) transfers: the share of it they were in flight, the bytes and their rate,
    and how it compares with the time those bytes take at what tiermem bench io measured (its floor)."""
    parts = [f"transfers in flight {row['io_busy_share']:.0%} of it"]
    for op, verb in (("read", "read"), ("write", "wrote")):
        if row[f"{op}_bytes"]:
            rate = f" at {row[f'{op}_gbps']:.2f} GB/s while in flight" if row[f"{op}_gbps"] else ""
            parts.append(f"{verb} {row[f'{op}_bytes'] / 1e9:.3f} GB{rate}")
    if row["floor_seconds"]:
        parts.append(f"{row['floor_seconds']:.3f} s at tiermem bench io's figures ({row['of_floor']:.2f}x that)")
    elif row["read_bytes"] or row["write_bytes"]:
        parts.append("no floor (no tiermem bench io figure for these drives)")
    return ", ".join(parts)


def _rate(row: dict[str, Any]) -> str:
    """Bytes moved, GB/s while in flight, and the `tiermem bench io` figure for the same drive."""
    text = f"{row['bytes'] / 1e6:.1f} MB"
    if row["gbps"]:
        text += f" at {row['gbps']:.2f} GB/s while in flight"
    if row["bench_gbps"]:
        share = f", {row['of_bench']:.0%} of" if row["of_bench"] else "; "
        text += f"{share} the {row['bench_gbps']:.2f} GB/s tiermem bench io measured there"
    elif row["bytes"]:
        text += f" (no bench figure for this drive: {row['bench_note']})"
    return text
