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


# TIERMEM_LIBURING_PREFIX: a liburing unpacked from Debian's liburing-dev (scripts/gpu_deps.sh), linked in
# statically, for a machine that has no liburing of its own (the lent GPU machine); else the system's.
_PREFIX = os.environ.get("TIERMEM_LIBURING_PREFIX")
_LINK: dict[str, list[str]] = (
    {"libraries": [], "extra_objects": [os.path.join(_PREFIX, "usr/lib/x86_64-linux-gnu/liburing.a")],
     "include_dirs": [os.path.join(_PREFIX, "usr/include")]}
    if _PREFIX else {"libraries": ["uring"], "extra_objects": [], "include_dirs": []})

def _builder(csrc: str) -> FFI:
    ffi = FFI()
    ffi.cdef(_declarations(_ROOT / "csrc" / "tm_uring.h"))
    ffi.set_source(
        "tiermem.io._uring_cffi",
        '#include "tm_uring.h"',
        sources=[os.path.join(csrc, "tm_uring.c")],
        include_dirs=[csrc, *_LINK["include_dirs"]],
        libraries=_LINK["libraries"],
        extra_objects=_LINK["extra_objects"],
        extra_compile_args=["-O2", "-Wall"],
        extra_link_args=["-pthread"],
        py_limited_api=True,  # one .so (abi3) for every CPython 3: one built here loads on the GPU machine's 3.12
    )
    return ffi


ffibuilder = _builder(_CSRC)

if __name__ == "__main__":  # python3 tiermem/io/_build_uring.py [TARGET_ROOT]: the .so under TARGET_ROOT/tiermem/io
    import sys

    _builder(str(_ROOT / "csrc")).compile(tmpdir=sys.argv[1] if len(sys.argv) > 1 else str(_ROOT), verbose=True)
