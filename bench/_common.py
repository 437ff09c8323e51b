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


def write_json(path: str, report: dict[str, Any]) -> None:
    """Write a benchmark's report where docs/benchmarks.md quotes it from."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"JSON written to {path}")
