"""tiermem's CPU allocator (memory.cpu_allocator): in place inside the context only, aligned like PyTorch's,
tensors outlive it, the heap keeps no holes that the same tensors cannot reuse, and a missing compiler is a
clear error or a warning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from tiermem import tiered_offload
from tiermem.cpu_allocator import cpu_allocator, cpu_allocator_installed, cpu_allocator_live_bytes

SMALL = {"params.tier": "cpu", "memory.host_budget": "16MiB"}


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter (a fresh heap, and tiermem's allocator not yet loaded)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, **(env or {})})


def test_in_place_inside_the_context_only_and_tensors_outlive_it() -> None:
    model = nn.Linear(64, 64)
    base = cpu_allocator_live_bytes()
    with tiered_offload(model, **SMALL):
        assert cpu_allocator_installed()
        kept = [torch.arange(n, dtype=torch.float32) for n in (1, 17, 1000, 3 << 18)]
        out = model(torch.randn(8, 64))
        assert cpu_allocator_live_bytes() >= base + sum(t.nbytes for t in kept)
        assert all(t.data_ptr() % 64 == 0 for t in kept)
        live = cpu_allocator_live_bytes()
        empty = torch.empty(0)
        assert empty.data_ptr() == 0 and cpu_allocator_live_bytes() == live  # nothing allocated for no bytes
    assert not cpu_allocator_installed()
    assert out.shape == (8, 64)
    assert all(torch.equal(t, torch.arange(t.numel(), dtype=torch.float32)) for t in kept)  # intact after exit
    total = sum(t.nbytes for t in kept)
    before = cpu_allocator_live_bytes()
    del kept
    assert cpu_allocator_live_bytes() == before - total  # freed through tiermem's deleter after the context


def test_nested_contexts_keep_it_until_the_last_exits() -> None:
    with tiered_offload(nn.Linear(8, 8), **SMALL):
        with tiered_offload(nn.Linear(8, 8), **SMALL):
            assert cpu_allocator_installed()
        assert cpu_allocator_installed()
    assert not cpu_allocator_installed()


def test_torch_setting_keeps_pytorchs_allocator() -> None:
    with tiered_offload(nn.Linear(8, 8), **SMALL, **{"memory.cpu_allocator": "torch"}):
        assert not cpu_allocator_installed()
        before = cpu_allocator_live_bytes()
        t = torch.empty(1 << 20)
        assert cpu_allocator_live_bytes() == before
    del t


def test_profiler_sees_its_allocations() -> None:
    from torch.profiler import ProfilerActivity, profile

    with cpu_allocator("tiermem"), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t = torch.ones(1 << 20)
        del t
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    assert allocated >= 4 << 20


HEAP_GROWTH = """
    import ctypes, sys, torch
    from tiermem.cpu_allocator import cpu_allocator

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    with cpu_allocator(sys.argv[1]) as used:
        torch.empty(64 << 20)  # freeing a big tensor raises glibc's mmap threshold: the rest go to the heap
        start = libc.mallinfo2().arena
        kept = []
        for layer in range(48):  # each layer: four 3 MiB temporaries, a small long-lived object after each
            temporaries = []
            for _ in range(4):
                temporaries.append(torch.empty(3 << 20, dtype=torch.uint8))
                kept.append(libc.malloc(24))  # like a graph node: small, alive until backward
            kept.append(torch.empty(256 << 10, dtype=torch.uint8))  # what the layer keeps
            del temporaries
        print(int(used), (libc.mallinfo2().arena - start) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_the_heap_reuses_freed_tensors() -> None:
    """48 layers of 12 MiB of temporaries that keep 12 MiB in all: with tiermem's allocator the heap holds one
    layer's temporaries and what is kept, whatever the number of layers. (With PyTorch's, glibc 2.36 grew it
    by 150 MiB here: every freed 3 MiB hole was too small for the next aligned 3 MiB.)"""
    done = run_python(HEAP_GROWTH.replace("sys.argv[1]", "'tiermem'"))
    assert done.returncode == 0, done.stderr
    used, growth = map(int, done.stdout.split())
    assert used == 1
    assert growth <= 12 + 12 + 8, f"the heap grew by {growth} MiB"


def test_without_a_compiler_auto_warns_and_tiermem_fails(tmp_path) -> None:
    code = """
        import logging, torch
        from torch import nn
        from tiermem import tiered_offload
        from tiermem.cpu_allocator import CPUAllocatorError, cpu_allocator_installed
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        kw = {"params.tier": "cpu", "memory.host_budget": "16MiB"}
        with tiered_offload(nn.Linear(8, 8), **kw):
            print("auto", cpu_allocator_installed())
        try:
            with tiered_offload(nn.Linear(8, 8), **kw, **{"memory.cpu_allocator": "tiermem"}):
                pass
        except CPUAllocatorError as exc:
            print("error:", exc)
    """
    env = {"TIERMEM_CACHE_DIR": str(tmp_path / "cache"), "PATH": str(tmp_path), "CXX": ""}
    done = run_python(code, env)
    assert done.returncode == 0, done.stderr
    assert "auto False" in done.stdout
    assert "memory.cpu_allocator: auto: using PyTorch's CPU allocator" in done.stderr
    assert "no C++ compiler found" in done.stderr
    assert "error: memory.cpu_allocator: tiermem: no C++ compiler found" in done.stdout
    assert "apt-get install g++" in done.stdout
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_failed_build_names_the_compiler_error_and_the_setting(tmp_path, monkeypatch) -> None:
    """A compiler that cannot build it (here: one that rejects every source) gives the compiler's message."""
    fake = tmp_path / "bad-c++"
    fake.write_text("#!/bin/sh\necho 'fatal error: c10/core/Allocator.h: No such file or directory' >&2\nexit 1\n")
    fake.chmod(0o755)
    code = """
        from tiermem.cpu_allocator import CPUAllocatorError, build_cpu_allocator
        try:
            build_cpu_allocator()
        except CPUAllocatorError as exc:
            print(exc)
    """
    done = run_python(code, {"TIERMEM_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(fake)})
    assert done.returncode == 0, done.stderr
    assert "tm_cpu_alloc.cpp against torch" in done.stdout
    assert "c10/core/Allocator.h: No such file or directory" in done.stdout
    assert "memory.cpu_allocator: torch" in done.stdout
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written library left behind



MMAP_PROBE = """
    import ctypes, ctypes.util
    from tiermem.cpu_allocator import cpu_allocator

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped(nbytes):  # whether glibc serves a malloc of nbytes with a mapping of its own (above its threshold)
        before = libc.mallinfo2().hblks
        p = libc.malloc(nbytes)
        got = libc.mallinfo2().hblks > before
        libc.free(p)
        return got

    with cpu_allocator("tiermem") as used:
        assert used
        inside = [mapped(4 << 20), mapped(16 << 20)]
    libc.malloc_trim(0)  # the heap's free top, kept while inside, would serve the next block whatever the thresholds
    print("inside", inside, "after", [mapped(4 << 20), mapped(4 << 20), mapped(16 << 20)])
"""


def test_glibc_thresholds_are_put_back_when_the_last_context_exits() -> None:
    """Inside the context glibc keeps blocks up to 32 MiB in its heap; after it, its thresholds are back where they
    started (128 KiB: every 4 MiB block gets a mapping of its own, again and again), or where the environment set
    them (8 MiB: 4 MiB blocks stay in the heap, 16 MiB ones do not)."""
    res = run_python(MMAP_PROBE)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "inside [False, False] after [True, True, True]" in res.stdout, res.stdout
    res = run_python(MMAP_PROBE, env={"MALLOC_MMAP_THRESHOLD_": str(8 << 20)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "inside [False, False] after [False, False, True]" in res.stdout, res.stdout
