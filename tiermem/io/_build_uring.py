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
    #define TM_ERR_EOF 1
    struct tm_engine;
    struct tm_xfer {
        uint64_t user_data;
        uint64_t addr;
        uint64_t offset;
        uint64_t len;
        int32_t fd;
        int32_t buffered_fd;
        int32_t op;
        uint32_t align;
    };
    struct tm_done {
        uint64_t user_data;
        int32_t res;
        uint32_t pad;
        uint64_t err_offset;
        uint64_t err_len;
    };
    int tm_engine_open(unsigned queue_depth, uint32_t block_size, int sqpoll, unsigned sq_idle_ms,
                       struct tm_engine **out);
    void tm_engine_close(struct tm_engine *eng);
    int tm_engine_start(struct tm_engine *eng);
    int tm_engine_enqueue(struct tm_engine *eng, const struct tm_xfer *xfers, unsigned n);
    int tm_engine_run(struct tm_engine *eng, struct tm_done *out, unsigned max);
    void tm_engine_kick(struct tm_engine *eng, int stop);
    int tm_engine_register_buffers(struct tm_engine *eng, const uint64_t *addrs, const uint64_t *lens,
                                   unsigned n);
    #define TM_NSTATS 4
    void tm_engine_stats(struct tm_engine *eng, uint64_t *out);
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
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(_ROOT), verbose=True)
