"""`tiermem demo`: run a transformer several times larger than the host budget from NVMe."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from tiermem.demo import add_arguments

    p = sub.add_parser("demo", help="generate with a GPT-2-shaped model from NVMe, with and without prefetch")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tiermem.demo import run as run_demo

    return run_demo(args)
