"""Builds the optional io_uring core (csrc/) with cffi when liburing is installed, and ships the CPU allocator's
C++ source (built at run time against the installed torch: tiermem/cpu_allocator.py); metadata is in pyproject.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

_PROBE = "#include <liburing.h>\nint main(void) { struct io_uring r; return io_uring_queue_init(2, &r, 0) > 0; }\n"


def liburing_usable() -> bool:
    """True when a C compiler can build and link against liburing (Debian: apt-get install liburing-dev)."""
    if os.environ.get("TIERMEM_NO_URING"):
        print("tiermem: TIERMEM_NO_URING is set; building without the io_uring core", file=sys.stderr)
        return False
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        print("tiermem: no C compiler found; building without the io_uring core", file=sys.stderr)
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(_PROBE)
        ok = subprocess.run([cc, src, "-luring", "-o", os.path.join(tmp, "probe")], capture_output=True).returncode == 0
    if not ok:
        print(
            "tiermem: liburing not found; building without the io_uring core (the threads backend will be used). "
            "Install liburing-dev and reinstall to enable io_uring.",
            file=sys.stderr,
        )
    return ok


class BuildPy(build_py):
    """Copies csrc/tm_cpu_alloc.cpp into the package (tiermem/_csrc/), where an installed tiermem finds it."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, "tiermem", "_csrc")
        os.makedirs(target, exist_ok=True)
        shutil.copy2(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "tm_cpu_alloc.cpp"), target)


setup(cffi_modules=["tiermem/io/_build_uring.py:ffibuilder"] if liburing_usable() else [],
      cmdclass={"build_py": BuildPy})
