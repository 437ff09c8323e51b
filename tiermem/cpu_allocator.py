"""Host memory that tiermem does not hold itself: glibc's heap, and PyTorch's CPU allocator.

# [Note: the CPU allocator]
On the CPU, the compute's own tensors (each layer's temporaries, the gradients autograd makes) come and go
in glibc's heap. PyTorch takes them with posix_memalign(64), and glibc serves an aligned request by carving
exactly the bytes asked for out of a larger free chunk and freeing the pieces around it. A freed tensor so
leaves a hole that the next request of the same size cannot use (it asks for the alignment on top), and the
small pieces beside the hole are taken by long-lived small allocations (autograd's graph nodes), so holes do
not merge. The heap then grows by every layer's temporaries in the first step, and the holes stay
resident: measured with bench/train_heap.py on the training bench's GPT-2 (with activations on NVMe), the
heap held 434 MiB after three steps, of which 155 MiB were in use, and the steps peaked at 1279-1323 MiB
of RSS against 1064-1072 MiB with the allocator below (docs/benchmarks.md).

``memory.cpu_allocator: auto`` (the default) therefore makes PyTorch's CPU allocator, for the time of the
context, one that takes the same 64-byte aligned memory with plain malloc of the size plus 80 bytes
(csrc/tm_cpu_alloc.cpp, whose header comment gives the block layout): the same tensor coming back asks
for the same size, and a freed hole fits it. With it, glibc's trim and mmap thresholds are raised while a
context uses it (see `_tune_glibc`; `_untune_glibc` puts them back), so that a step's temporaries stay
resident for the next step instead of being given back and faulted in again. It is C++ against the
installed torch's headers, so it is built at first use by torch.utils.cpp_extension with the system's C++
compiler and cached (see `_cache_dir`); ``auto`` falls back to PyTorch's allocator, with a warning, when
it cannot be built, and ``tiermem`` makes that an error.
Tensors keep the deleter of the allocator that made them, so putting PyTorch's back when the last
context using tiermem's exits frees everything correctly.

`trim()` asks glibc to return freed heap memory (malloc_trim); it is cheap when there is little to give
back, and a no-op where glibc is absent.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tiermem.errors import CPUAllocatorError

log = logging.getLogger(__name__)

_SOURCE = "tm_cpu_alloc.cpp"


def _libc_function(name: str) -> Any:
    """glibc's `name`, or None where there is no glibc (or no such function). Looked up at import only:
    find_library runs `ldconfig -p` in a child process, and a signal landing in that process object's
    teardown would be dropped by Python (see [Note: interrupts] in tiermem/interrupts.py)."""
    lib = ctypes.util.find_library("c")
    if not lib:
        return None
    try:
        return getattr(ctypes.CDLL(lib), name)
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc_function("malloc_trim")
_mallopt_fn = _libc_function("mallopt")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
TRIM_THRESHOLD = 256 << 20
MMAP_THRESHOLD = 32 << 20  # the most glibc's dynamic threshold reaches on 64-bit


# glibc's thresholds before tiermem sets them: what the environment asked for, else glibc's defaults (128 KiB)
_GLIBC_BEFORE = ((M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_"), (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_"))
_GLIBC_DEFAULT = 128 << 10


def _mallopt(settings: tuple[tuple[int, int], ...]) -> None:
    mallopt = _mallopt_fn
    if mallopt is None:
        return
    for param, value in settings:
        if not mallopt(param, value):
            log.debug("mallopt(%d, %d) was refused", param, value)


def _untune_glibc() -> None:
    """Put glibc's thresholds back as they were before `_tune_glibc`: the values of MALLOC_MMAP_THRESHOLD_ and
    MALLOC_TRIM_THRESHOLD_ when the environment set them, else glibc's starting values (128 KiB each). glibc
    has no call that reads them, nor one that turns its dynamic adjustment back on, so after a context the
    thresholds stay where glibc starts, no longer growing with the sizes freed."""
    settings = []
    for param, env in _GLIBC_BEFORE:
        try:
            settings.append((param, int(os.environ.get(env, _GLIBC_DEFAULT))))
        except ValueError:
            settings.append((param, _GLIBC_DEFAULT))
    _mallopt(tuple(settings))


def _tune_glibc() -> None:
    """Keep the compute's memory in the heap and resident between steps (glibc's mallopt), while a context
    uses tiermem's allocator (`_untune_glibc` when the last one exits).

    glibc gives the free memory at the top of its heap back to the OS when it exceeds the trim threshold
    (dynamically twice the mmap threshold, at most 64 MiB). Once the heap keeps no holes, a step's
    temporaries end at its top, so every step gave them back and faulted them in again: 20,000 page
    faults per step on the training bench's GPT-2, none with the threshold at 256 MiB, at the same peak
    RSS (memory is given back after the peak, never before it). Setting it turns glibc's dynamic
    thresholds off, so the mmap threshold is fixed too, at the 32 MiB the dynamic one ends up at.
    """
    _mallopt(((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


def trim() -> None:
    """Return freed heap memory to the OS (glibc's malloc_trim(0))."""
    if _malloc_trim is not None:
        _malloc_trim(0)


# -- the CPU allocator --------------------------------------------------------------------------------
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_users = 0  # contexts using tiermem's allocator now; the last one out puts PyTorch's back
_warned = False


def _source() -> Path:
    """csrc/tm_cpu_alloc.cpp: beside the package in a source checkout, inside it in a wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc" / _SOURCE, here / "_csrc" / _SOURCE):
        if candidate.is_file():
            return candidate
    raise CPUAllocatorError(f"{_SOURCE} is missing from the tiermem installation (looked in {here.parent / 'csrc'}"
                            f" and {here / '_csrc'}); reinstall tiermem, or set memory.cpu_allocator: torch")


def _cache_dir() -> Path:
    """$TIERMEM_CACHE_DIR, else $XDG_CACHE_HOME/tiermem, else ~/.cache/tiermem."""
    env = os.environ.get("TIERMEM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiermem"


def _compiler() -> str:
    for cxx in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    raise CPUAllocatorError("no C++ compiler found (looked for $CXX, g++, c++ and clang++); install one "
                            "(Debian: apt-get install g++), or set memory.cpu_allocator: torch")


def build_cpu_allocator() -> Path:
    """The shared library of tiermem's CPU allocator for the installed torch, built on first use with
    PyTorch's own extension builder (torch.utils.cpp_extension: torch's headers, libraries, ABI and flags,
    ninja, and a lock against two processes building at once) into tiermem's cache, one build per source
    and torch."""
    import torch
    from torch.utils import cpp_extension

    src = _source()
    root = Path(torch.__file__).resolve().parent
    key = hashlib.sha256(b"\0".join([src.read_bytes(), torch.__version__.encode(), str(root).encode()])).hexdigest()
    name = f"tm_cpu_alloc_{key[:16]}"
    folder = _cache_dir() / name
    out = folder / f"{name}.so"
    if out.is_file():
        return out
    cxx = _compiler()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CPUAllocatorError(f"cannot create the build cache {folder} ({exc.strerror}); set TIERMEM_CACHE_DIR to "
                                "a writable directory, or set memory.cpu_allocator: torch") from exc
    before = os.environ.get("CXX")
    os.environ["CXX"] = cxx  # the compiler found above, which cpp_extension takes from $CXX
    try:
        built = cpp_extension.load(name=name, sources=[str(src)], build_directory=str(folder), extra_cflags=["-O2"],
                                   is_python_module=False, verbose=False)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(folder, ignore_errors=True)  # nothing half-built is left to be taken for a library
        said = getattr(exc, "output", None) or getattr(exc, "stderr", None) or b""  # the compiler's own words
        detail = (said.decode(errors="replace") if isinstance(said, bytes) else str(said)).strip()
        raise CPUAllocatorError(f"building {src.name} against torch {torch.__version__} with {cxx} failed: "
                                f"{str(exc)[-1000:]}\n{detail[-2000:]}\nset memory.cpu_allocator: torch to use "
                                "PyTorch's own allocator") from exc
    finally:
        if before is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = before
    log.info("built tiermem's CPU allocator for torch %s: %s", torch.__version__, built)
    return Path(built) if isinstance(built, str) else out


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        import torch  # noqa: F401  (libc10 must be loaded for the library's symbols to resolve)

        path = build_cpu_allocator()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:  # e.g. built against another torch's libc10 and its symbols differ
            raise CPUAllocatorError(f"loading {path} failed ({exc}); delete it to rebuild, or set "
                                    "memory.cpu_allocator: torch") from exc
        lib.tm_cpu_alloc_live_bytes.restype = ctypes.c_size_t
        _lib = lib
    return _lib


def cpu_allocator_installed() -> bool:
    """True while tiermem's allocator is PyTorch's CPU allocator."""
    return _lib is not None and bool(_lib.tm_cpu_alloc_installed())


def cpu_allocator_live_bytes() -> int:
    """Bytes of CPU tensors that tiermem's allocator has handed out and that are not yet freed."""
    return 0 if _lib is None else int(_lib.tm_cpu_alloc_live_bytes())


@contextlib.contextmanager
def cpu_allocator(setting: str) -> Iterator[bool]:
    """Use tiermem's CPU allocator inside the block as memory.cpu_allocator says; yields whether it is used."""
    global _users, _warned
    if setting == "torch":
        yield False
        return
    with _lock:
        try:
            lib = _load()
            if not lib.tm_cpu_alloc_install():
                raise CPUAllocatorError("another CPU allocator was registered with a higher priority and keeps its "
                                        "place; set memory.cpu_allocator: torch")
            if _users == 0:
                _tune_glibc()
            _users += 1
        except CPUAllocatorError as exc:
            if setting == "tiermem":
                raise CPUAllocatorError(f"memory.cpu_allocator: tiermem: {exc}") from exc
            if not _warned:
                _warned = True
                log.warning("memory.cpu_allocator: auto: using PyTorch's CPU allocator, whose freed memory glibc "
                            "keeps resident in holes (see tiermem/cpu_allocator.py): %s", exc)
            lib = None
    if lib is None:
        yield False
        return
    try:
        yield True
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                lib.tm_cpu_alloc_uninstall()
                _untune_glibc()
