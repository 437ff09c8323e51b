"""Run a command as a machine with less memory would: in a memory cgroup of its own (v2 or v1), swap off.
A test tool; skipped with a reason where no memory cgroup can be made (not root, no controller)."""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/memory")


@dataclass
class Limited:
    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int  # the group's peak memory, page cache included
    oom_kills: int  # processes the kernel killed for memory in the group


def cgroup_unavailable() -> str | None:
    """Why no memory cgroup can be made here, or None."""
    if os.geteuid() != 0:
        return "making a memory cgroup needs root"
    if (V2 / "cgroup.controllers").exists():
        if "memory" not in (V2 / "cgroup.controllers").read_text().split():
            return "cgroup v2 without the memory controller"
        return None
    if (V1 / "memory.limit_in_bytes").exists():
        return None
    return "no memory cgroup (v1 or v2) mounted under /sys/fs/cgroup"


def run_limited(limit: int, argv: list[str], *, timeout: float, env: dict[str, str] | None = None) -> Limited:
    """Run `argv` in a fresh memory cgroup of `limit` bytes; the group is removed afterwards."""
    v2 = (V2 / "cgroup.controllers").exists()
    group = (V2 if v2 else V1) / f"tiermem-test-{uuid.uuid4().hex[:12]}"
    group.mkdir()
    try:
        if v2:
            (group / "memory.max").write_text(str(limit))
            swap = group / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        else:
            (group / "memory.limit_in_bytes").write_text(str(limit))
            memsw = group / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit))
        # the child joins the group before it execs the command, so every byte it maps is counted
        wrapper = ["/bin/sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "sh", *argv]
        proc = subprocess.run(wrapper, capture_output=True, text=True, timeout=timeout, env=env)
        if v2:
            peak_file = group / "memory.peak"
            peak = int(peak_file.read_text()) if peak_file.exists() else 0
            events = dict(line.split() for line in (group / "memory.events").read_text().splitlines())
            kills = int(events.get("oom_kill", 0))
        else:
            peak = int((group / "memory.max_usage_in_bytes").read_text())
            control = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
            kills = int(control.get("oom_kill", 0))
        return Limited(proc.returncode, proc.stdout, proc.stderr, peak, kills)
    finally:
        group.rmdir()
