"""Shared fixtures: engines for every usable backend, the compute devices the offload tests run on, and real
filesystems mounted for fallbacks."""

from __future__ import annotations

import gc
import os
import subprocess
from collections.abc import Iterator

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


def pytest_report_header(config: pytest.Config) -> str:
    return f"tiermem test device: {', '.join(DEVICES)}"


@pytest.fixture(params=DEVICES)
def compute_device(request: pytest.FixtureRequest) -> Iterator[CopyingDevice | None]:
    """The test runs on this compute device; on the copying one, no device memory may outlive it."""
    if request.param == "cpu":
        yield None
        return
    with copying_device() as dev:
        before = dev.live_bytes
        yield dev
        gc.collect()
        assert dev.live_bytes == before, f"{dev.live_bytes - before} bytes of device memory outlived the test"


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
