#!/usr/bin/env python3
"""Run a command with the disk under a folder read and written at set speeds: every process the command
starts meets the same slower disk through the kernel's block throttle (`disk_rate_capped` in
bench/_common.py), the processes outside keep the disk as it is. For a bench's ratio between tools on a disk
of another speed than this machine's (docs/benchmarks.md: issue 13's goal on the disk it was set on). Needs
root.

    python3 bench/throttled.py --read 1.75GB --write 2.2GB /var/tmp/tiermem-ranks-bench -- \\
        python3 bench/train_ranks.py --variants ddp,tiermem_default,deepspeed --rounds 1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import disk_rate_capped  # noqa: E402

from tiermem.sizes import parse_size  # noqa: E402


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--read", help="reads' cap, bytes a second (e.g. 1.75GB); not capped if left out")
    p.add_argument("--write", help="writes' cap, bytes a second (e.g. 2.2GB); not capped if left out")
    p.add_argument("folder", help="a folder on the disk to throttle (made if missing)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    rates = {}
    for key in ("read", "write"):
        value = getattr(args, key)
        if value is not None:
            try:
                rates[key] = parse_size(value, what=f"--{key}")
            except ValueError as exc:
                p.error(str(exc))
            if rates[key] < 1 << 20:
                p.error(f"--{key} {value}: under 1 MiB a second even the command's own start would crawl")
    if not rates:
        p.error("give --read, --write or both")
    os.makedirs(args.folder, exist_ok=True)
    with disk_rate_capped(args.folder, **rates) as device:
        caps = ", ".join(f"{k}s at most {v / 1e9:.3g} GB/s" for k, v in rates.items())
        print(f"throttled.py: {args.folder} on disk {device}: {caps}", file=sys.stderr, flush=True)
        return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
