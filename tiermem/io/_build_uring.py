"""cffi (API mode) build script for the io_uring core in csrc/; setup.py runs it when liburing is present."""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

_ROOT = Path(__file__).resolve().parents[2]
# setuptools wants paths relative to the project root, where pip runs setup.py
_CSRC = os.path.relpath(_ROOT / "csrc", os.getcwd())

ffibuilder = FFI()
ffibuilder.cdef(
    """
    #define TM_OP_READ 0
    #define TM_OP_WRITE 1
    #define TM_OP_NOP 2
    struct tm_ring;
    struct tm_req {
        uint64_t user_data;
        uint64_t addr;
        uint64_t offset;
        uint32_t len;
        int32_t fd;
        int32_t op;
        int32_t buf_index;
    };
    struct tm_cqe {
        uint64_t user_data;
        int32_t res;
        uint32_t flags;
    };
    int tm_ring_open(unsigned entries, int sqpoll, unsigned sq_idle_ms, struct tm_ring **out);
    void tm_ring_close(struct tm_ring *ring);
    unsigned tm_ring_sq_entries(struct tm_ring *ring);
    unsigned tm_ring_features(struct tm_ring *ring);
    int tm_ring_register_buffers(struct tm_ring *ring, const uint64_t *addrs, const uint64_t *lens,
                                 unsigned n);
    int tm_ring_unregister_buffers(struct tm_ring *ring);
    int tm_ring_submit(struct tm_ring *ring, const struct tm_req *reqs, unsigned n);
    int tm_ring_reap(struct tm_ring *ring, struct tm_cqe *out, unsigned max, unsigned wait_nr);
    int tm_ring_probe(void);
    """
)
ffibuilder.set_source(
    "tiermem.io._uring_cffi",
    '#include "tm_uring.h"',
    sources=[os.path.join(_CSRC, "tm_uring.c")],
    include_dirs=[_CSRC],
    libraries=["uring"],
    extra_compile_args=["-O2", "-Wall"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(_ROOT), verbose=True)
