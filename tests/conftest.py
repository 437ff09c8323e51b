"""Shared fixtures: engines for every usable backend, and real filesystems mounted for fallbacks."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from tiermem.io.engine import IOEngine, available_backends, create_engine

BACKENDS = ["io_uring", "threads"]


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
