"""cffi (API mode) build script for the io_uring core in csrc/; setup.py runs it when liburing is present."""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

_ROOT = Path(__file__).resolve().parents[2]
# setuptools wants paths relative to the project root, where pip runs setup.py
_CSRC = os.path.relpath(_ROOT / "csrc", os.getcwd())


def _declarations(header: Path) -> str:
    """csrc/tm_uring.h as cffi's cdef wants it: the header guard and includes dropped (cffi knows the
    stdint types and strips comments), so the C header stays the one place the interface is written."""
    skip = ("#ifndef", "#endif", "#include", "#define TM_URING_H")
    return "\n".join(line for line in header.read_text(encoding="utf-8").splitlines()
                     if not line.strip().startswith(skip))


ffibuilder = FFI()
ffibuilder.cdef(_declarations(_ROOT / "csrc" / "tm_uring.h"))
ffibuilder.set_source(
    "tiermem.io._uring_cffi",
    '#include "tm_uring.h"',
    sources=[os.path.join(_CSRC, "tm_uring.c")],
    include_dirs=[_CSRC],
    libraries=["uring"],
    extra_compile_args=["-O2", "-Wall"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(_ROOT), verbose=True)
