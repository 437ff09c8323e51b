"""The `tiermem` command line: `tiermem demo`, `tiermem info`, `tiermem bench io`, `tiermem config check|show`,
`tiermem report TRACE`, `tiermem plan CONFIG --hf-config config.json`, `tiermem tune --path DIR`."""

from __future__ import annotations

import argparse
import logging
import sys

from tiermem.errors import TiermemError


def build_parser() -> argparse.ArgumentParser:
    from tiermem.cli import bench, config_cmd, demo, info, plan, report, rescue_cmd, tune

    parser = argparse.ArgumentParser(prog="tiermem", description="Tiered memory for PyTorch: device, host RAM, NVMe.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what tiermem does (INFO level)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    info.register(sub)
    bench.register(sub)
    config_cmd.register(sub)
    demo.register(sub)
    report.register(sub)
    plan.register(sub)
    tune.register(sub)
    rescue_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="tiermem: %(levelname)s: %(message)s")
    try:
        return int(args.func(args))
    except TiermemError as exc:
        print(f"tiermem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tiermem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
