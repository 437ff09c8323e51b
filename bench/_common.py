"""Helpers shared by the benchmark scripts in bench/ (they run as `python3 bench/NAME.py`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, for the system header."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def tiermem_tree() -> dict[str, Any]:
    """The commit tiermem was measured at, and whether tiermem/ had uncommitted changes."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "uncommitted_in_tiermem": bool(git("status", "--porcelain", "--", "tiermem"))}


def package_versions(*names: str) -> dict[str, str]:
    """Each installed package's version, or "not installed", for the system header."""
    import importlib.metadata

    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def print_system_header(title: str, system: dict[str, Any], versions: dict[str, str]) -> None:
    """The first lines every benchmark prints: machine, the paths it measures on, and the versions."""
    print(f"{title}  |  Linux {system['kernel']} {system['machine']}, {system['cpus']} CPUs "
          f"({system['cpu_model']}), {system['memory_gib']:.0f} GiB RAM, Python {system['python']}")
    for p in system["paths"]:
        print(f"  {p['path']}: {p['filesystem']}, device {p['device'] or '?'} ({p['model'] or 'unknown model'})")
    line = "  versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())
    tree = system.get("tiermem_tree")
    if tree:
        line += f"; tiermem at {(tree['commit'] or '?')[:12]}"
        line += " + uncommitted changes" if tree["uncommitted_in_tiermem"] else ""
    print(line)


def write_json(path: str, report: dict[str, Any]) -> None:
    """Write a benchmark's report where docs/benchmarks.md quotes it from."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"JSON written to {path}")
