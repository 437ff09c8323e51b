"""`tiermem info`: which I/O backends work here and why, and what the machine offers."""

from __future__ import annotations

import argparse
import json
import os
import platform

from tiermem.io.bandwidth import system_info


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="show usable I/O backends, CUDA and the swap paths' devices")
    p.add_argument("--path", action="append", default=None, help="swap directory to describe (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    paths = args.path or [os.environ.get("TMPDIR", "/var/tmp")]
    info = system_info(paths)
    info["tiermem"] = _version()
    info["torch"], info["cuda"] = _torch()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"tiermem {info['tiermem']} on Linux {info['kernel']} ({platform.machine()}, {info['cpus']} CPUs), "
          f"Python {info['python']}")
    print(f"torch: {info['torch']}; CUDA: {info['cuda']}")
    print("I/O backends:")
    for name, state in info["engines"].items():
        print(f"  {name:<9} {'yes' if state == 'available' else 'no: ' + state}")
    print(f"transparent huge pages: {info['transparent_hugepage']}")
    for p in info["paths"]:
        print(f"path {p['path']}: {p['filesystem']}, device {p['device'] or '?'} ({p['model'] or 'unknown model'}"
              f"{', rotational' if p['rotational'] else ''})")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tiermem")
    except PackageNotFoundError:
        return "unknown"


def _torch() -> tuple[str, str]:
    try:
        import torch
    except ImportError:
        return "not installed", "no"
    if torch.cuda.is_available():
        return torch.__version__, f"yes ({torch.cuda.get_device_name(0)})"
    return torch.__version__, "no (the compute device is the CPU)"
