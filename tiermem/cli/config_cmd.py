"""`tiermem config check FILE...`, `tiermem config show [FILE]` and `tiermem config from-deepspeed FILE`: validate,
print and convert swap-configs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tiermem.config import format_config, load_config, parse_yaml
from tiermem.errors import ConfigError
from tiermem.sizes import short_repr

# Exit status for a config that does not validate; 1 is left for unexpected failures.
EXIT_BAD_CONFIG = 2


def _parse_set(text: str) -> tuple[str, Any]:
    """Turn ``KEY=VALUE`` into (key, value), reading VALUE as YAML so ``4`` is an int.

    VALUE is read with the config loader's bounds (an alias bomb, deep nesting or an endless integer is
    refused), and a failure is an argparse usage error that names KEY.
    """
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE such as prefetch.depth=4, got {short_repr(text)}")
    try:
        parsed = parse_yaml(value, key) if value.strip() else None
    except ConfigError as exc:  # a ValueError, which argparse would report without its message
        raise argparse.ArgumentTypeError(str(exc)) from None
    return key, parsed


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Collect the --set pairs, later ones winning."""
    return dict(args.set or [])


def _error_line(file: str, exc: ConfigError) -> str:
    """Prefix the message with the file unless it already starts with it (unreadable-file errors)."""
    message = str(exc)
    return message if message.startswith(file) else f"{file}: {message}"


def run_check(args: argparse.Namespace) -> int:
    """Validate each FILE; print "FILE: ok" or the error, exit 0 if all pass, else 2."""
    status = 0
    for file in args.files:
        try:
            load_config(file, **_overrides(args))
        except ConfigError as exc:
            print(_error_line(file, exc), file=sys.stderr)
            status = EXIT_BAD_CONFIG
        else:
            print(f"{file}: ok")
    return status


def run_show(args: argparse.Namespace) -> int:
    """Print the effective config of FILE (or the defaults) with every key filled in."""
    try:
        cfg = load_config(args.file, **_overrides(args))
    except ConfigError as exc:
        print(_error_line(args.file, exc) if args.file else str(exc), file=sys.stderr)
        return EXIT_BAD_CONFIG
    sys.stdout.write(format_config(cfg))
    return 0


def run_from_deepspeed(args: argparse.Namespace) -> int:
    """Print the swap-config a DeepSpeed JSON config maps to; one warning line on stderr per key that has
    no equivalent or means something else."""
    from tiermem.migrate import from_deepspeed

    try:
        with open(args.file, encoding="utf-8") as f:
            ds = json.load(f, object_pairs_hook=_unique_keys)
        overrides, warnings = from_deepspeed(ds)
        cfg = load_config(None, **overrides)
    except RecursionError:
        print(f"{args.file}: JSON nested deeper than Python's reader follows; a DeepSpeed config is a few levels "
              "deep: check that this is the file meant", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (OSError, ValueError) as exc:  # JSONDecodeError, ConfigError are ValueErrors
        print(f"{args.file}: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, no traceback
        return EXIT_BAD_CONFIG
    for line in warnings:
        print(f"tiermem: warning: {line}", file=sys.stderr)
    sys.stdout.write(format_config(cfg))
    return 0


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a key given twice is refused, as DeepSpeed refuses it, since json would
    silently keep the last."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ConfigError(f"{key}: given twice in one object; DeepSpeed refuses duplicate keys, so keep one")
        obj[key] = value
    return obj


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``config`` command and its ``check`` and ``show`` subcommands to `subparsers`."""
    parser = subparsers.add_parser(
        "config",
        help="validate or print a swap-config",
        description="Validate swap-config YAML files or print the effective config. See docs/config.md for every key.",
    )
    commands = parser.add_subparsers(dest="config_command", metavar="{check,show,from-deepspeed}")
    commands.required = True

    set_help = "override one key after reading the file, e.g. --set prefetch.depth=4 (repeatable)"

    check = commands.add_parser(
        "check",
        help="validate config files",
        description="Validate each FILE. Prints 'FILE: ok' per valid file; exits 2 if any is invalid.",
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="a swap-config YAML file")
    check.add_argument("--set", action="append", type=_parse_set, metavar="KEY=VALUE", help=set_help)
    check.set_defaults(func=run_check)

    show = commands.add_parser(
        "show",
        help="print the effective config",
        description="Print the config FILE describes (or the defaults) with every key filled in,"
        " as YAML that 'config check' accepts.",
    )
    show.add_argument("file", nargs="?", metavar="FILE", help="a swap-config YAML file")
    show.add_argument("--set", action="append", type=_parse_set, metavar="KEY=VALUE", help=set_help)
    show.set_defaults(func=run_show)

    convert = commands.add_parser(
        "from-deepspeed",
        help="convert a DeepSpeed ZeRO config to a swap-config",
        description="Print the swap-config that DeepSpeed config FILE (JSON) maps to; on stderr, one warning per "
        "key with no equivalent or another meaning, saying what tiermem does instead. What DeepSpeed refuses (an "
        "offload device other than none, cpu or nvme; fp16 and bf16 both enabled; ...) is an error naming the key "
        "and DeepSpeed's rule, exit status 2. See docs/config.md.",
    )
    convert.add_argument("file", metavar="FILE", help="a DeepSpeed config (ds_config.json)")
    convert.set_defaults(func=run_from_deepspeed)
