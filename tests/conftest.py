"""Shared fixtures: engines for every usable backend, the compute devices the offload tests run on, and real
filesystems mounted for fallbacks."""

from __future__ import annotations

import gc
import os
import subprocess
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

# Plain PyTorch is the reference of every exactness test, and it is not reproducible from one process to the next
# on its own: Intel MKL (PyTorch's CPU BLAS) picks its kernels at run time, and about one process in ten of the
# reference in test_limited.py computed different last bits (which AdamW turns into 7e-5 in the weights). MKL's
# conditional numerical reproducibility fixes its kernels. Set before the first matrix product, in this process
# and in every child it starts; a value the caller set is kept.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from tiermem.device import CopyingDevice, copying_device
from tiermem.io.backends import available_backends, create_engine
from tiermem.io.engine import IOEngine

BACKENDS = ["io_uring", "threads"]
# The compute devices the tests that touch the device run on: the CPU itself, and the copying test device
# (see [Note: copying test device] in tiermem/device.py). TIERMEM_TEST_DEVICE=cpu or =copy runs one.
DEVICES = [d for d in ("cpu", "copy") if os.environ.get("TIERMEM_TEST_DEVICE", d) == d]
if not DEVICES:
    raise pytest.UsageError(f"TIERMEM_TEST_DEVICE={os.environ['TIERMEM_TEST_DEVICE']!r}: expected cpu or copy")


# The copying device's copies land after seeded random delays ([Note: as strict as a GPU] in tiermem/device.py):
# a new seed each run, so orderings vary from run to run, and TIERMEM_COPY_SEED=N repeats a run's.
COPY_SEED = int(os.environ.get("TIERMEM_COPY_SEED") or zlib.crc32(os.urandom(4)) % 100_000)


def pytest_report_header(config: pytest.Config) -> str:
    return (f"tiermem test device: {', '.join(DEVICES)}"
            + (f"; copy streams seeded with TIERMEM_COPY_SEED={COPY_SEED}" if "copy" in DEVICES else ""))


@contextmanager
def on_copying_device(nodeid: str) -> Iterator[CopyingDevice]:
    """The copying device for one test: no device memory may outlive it and no copy may race its source."""
    seed = COPY_SEED + zlib.crc32(nodeid.encode())  # each test its own orderings, whatever runs before it
    with copying_device(seed=seed) as dev:
        before, faults = dev.live_bytes, len(dev.faults)
        yield dev
        gc.collect()
        assert dev.live_bytes == before, f"{dev.live_bytes - before} bytes of device memory outlived the test"
        assert len(dev.faults) == faults, f"copies raced their sources (TIERMEM_COPY_SEED={COPY_SEED}): " + \
            "; ".join(map(str, dev.faults[faults:]))


@pytest.fixture(params=DEVICES)
def compute_device(request: pytest.FixtureRequest) -> Iterator[CopyingDevice | None]:
    """The test runs on this compute device (None: the CPU itself)."""
    if request.param == "cpu":
        yield None
        return
    with on_copying_device(request.node.nodeid) as dev:
        yield dev


# The process groups the multi-rank tests run on (tests/ranks.py): gloo, and the NCCL-like strict group on the
# copying device. TIERMEM_TEST_RANKS=gloo or =strict runs one.
RANK_BACKENDS = [b for b in ("gloo", "strict") if os.environ.get("TIERMEM_TEST_RANKS", b) == b]
if not RANK_BACKENDS:
    raise pytest.UsageError(f"TIERMEM_TEST_RANKS={os.environ['TIERMEM_TEST_RANKS']!r}: expected gloo or strict")


@pytest.fixture(params=RANK_BACKENDS)
def rank_backend(request: pytest.FixtureRequest) -> str:
    """The multi-rank test runs its ranks on this process group (tests/ranks.py)."""
    return str(request.param)


def _backend_param(name: str) -> object:
    reason = available_backends()[name]
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=f"{name}: {reason}"))


@pytest.fixture(params=[_backend_param(b) for b in BACKENDS])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def engine(backend: str) -> Iterator[IOEngine]:
    with create_engine(backend, block_size=64 << 10, queue_depth=8) as eng:
        yield eng


def _mount(fstype: str, target: str, options: str | None = None) -> None:
    cmd = ["mount", "-t", fstype, fstype, target] + (["-o", options] if options else [])
    if os.geteuid() != 0:
        pytest.skip(f"mounting {fstype} needs root")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: {res.stderr.strip()}")


@pytest.fixture
def ramfs_dir(tmp_path: os.PathLike[str]) -> Iterator[str]:
    """A real ramfs mount: a filesystem that refuses O_DIRECT with EINVAL."""
    target = os.path.join(os.fspath(tmp_path), "ramfs")
    os.mkdir(target)
    _mount("ramfs", target)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", target], check=False)


@pytest.fixture
def small_fs_dir(tmp_path: os.PathLike[str]) -> Iterator[str]:
    """A real 16 MiB tmpfs mount, to fill up."""
    target = os.path.join(os.fspath(tmp_path), "small")
    os.mkdir(target)
    _mount("tmpfs", target, "size=16m")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", target], check=False)
