"""`tiermem demo`: run a transformer several times larger than the host budget from NVMe."""

from __future__ import annotations

import argparse

from tiermem.errors import DemoArgError
from tiermem.sizes import parse_size

# The size flags, checked before anything is built, so that a bad one is one line naming it, not a traceback.
SIZE_FLAGS = (("--host-budget", "host_budget"), ("--train-budget", "train_budget"))


def register(sub: argparse._SubParsersAction) -> None:
    from tiermem.demo import add_arguments

    p = sub.add_parser("demo", help="generate with a GPT-2-shaped model from NVMe, with and without prefetch")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tiermem.demo import run as run_demo

    for flag, dest in SIZE_FLAGS:
        try:
            parse_size(getattr(args, dest), what=flag)
        except ValueError as exc:  # the message starts with the flag
            raise DemoArgError(str(exc)) from None
    return run_demo(args)
