"""The swap store: extents, striping across directories, run directories, locking, cleanup, full disks."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tiermem.errors import StoreError
from tiermem.io.buffers import AlignedBuffer
from tiermem.io.engine import IOEngine
from tiermem.store import SwapStore
from tiermem.store.store import OWNER_FILE, SWAP_FILE


def _random(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_extents_round_trip_and_do_not_overlap(engine: IOEngine, tmp_path) -> None:
    """Many extents of odd sizes keep their own bytes; freed room is reused."""
    with SwapStore([str(tmp_path)], engine) as store:
        blobs = [_random(n, n) for n in (1, 4095, 4096, 70_001, 1 << 20, 3_000_017)]
        extents = [store.allocate(len(b)) for b in blobs]
        for fut in [store.write(e, b) for e, b in zip(extents, blobs, strict=True)]:
            fut.wait()
        for e, b in zip(extents, blobs, strict=True):
            out = np.zeros_like(b)
            store.read(e, out).wait()
            assert np.array_equal(out, b)
        spans = sorted((e.start, e.start + e.size) for e in extents)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        store.free(extents[2])
        store.free(extents[3])
        again = store.allocate(8192)
        assert again.start == extents[2].start  # first fit reuses the merged hole


def test_striping_puts_alternate_chunks_on_each_directory(engine: IOEngine, tmp_path) -> None:
    """With two directories and a 64 KiB stripe, chunk k lands in directory k % 2 at (k // 2) * 64 KiB."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    stripe = 64 << 10
    with SwapStore(dirs, engine, stripe_size=stripe) as store:
        data = _random(6 * stripe + 1000, 3)
        ext = store.allocate(len(data))
        store.write(ext, data).wait()
        files = [os.path.join(d, SWAP_FILE) for d in store.run_dirs]
        raw = [np.fromfile(f, dtype=np.uint8) for f in files]
        for k in range(7):
            chunk = data[k * stripe:(k + 1) * stripe]
            on_disk = raw[k % 2][(k // 2) * stripe:(k // 2) * stripe + len(chunk)]
            assert np.array_equal(chunk, on_disk), f"stripe chunk {k}"
        out = np.zeros_like(data)
        store.read(ext, out).wait()
        assert np.array_equal(out, data)
        part = np.zeros(3 * stripe, dtype=np.uint8)
        store.read(ext, part, len(part), offset=stripe // 2).wait()  # a range across three chunks
        assert np.array_equal(part, data[stripe // 2:stripe // 2 + len(part)])


def test_run_directory_is_private_and_removed_on_close(engine: IOEngine, tmp_path) -> None:
    """Run dirs are 0700, swap files 0600 and preallocated; both vanish on close."""
    store = SwapStore([str(tmp_path)], engine)
    run_dir = store.run_dirs[0]
    store.allocate(5 << 20)
    swap = os.path.join(run_dir, SWAP_FILE)
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(swap).st_mode) == 0o600
    assert os.stat(swap).st_blocks * 512 >= 5 << 20  # fallocate reserved the blocks
    store.close()
    assert not os.path.exists(run_dir)


def test_keep_files_leaves_data_for_a_later_run(engine: IOEngine, tmp_path) -> None:
    """keep_files=True keeps the run dir; reopening it by name finds the bytes."""
    data = _random(100_000, 5)
    with SwapStore([str(tmp_path)], engine, keep_files=True, run_name="kept") as store:
        ext = store.allocate(len(data))
        store.write(ext, data).wait()
        store.flush()
    assert os.path.isfile(tmp_path / "kept" / SWAP_FILE)
    with SwapStore([str(tmp_path)], engine, run_name="kept") as again:
        out = np.zeros_like(data)
        again.read(ext, out).wait()
    assert np.array_equal(out, data)


def test_two_processes_never_share_a_run_directory(engine: IOEngine, tmp_path) -> None:
    """A second process opening a run dir in use gets StoreError naming the holder's pid."""
    with SwapStore([str(tmp_path)], engine, run_name="busy"):
        script = textwrap.dedent(f"""
            from tiermem.io.engine import create_engine
            from tiermem.store import SwapStore
            from tiermem.errors import StoreError
            try:
                SwapStore([{str(tmp_path)!r}], create_engine("threads"), run_name="busy")
            except StoreError as exc:
                print(exc)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "in use by another process" in out and f"pid {os.getpid()}" in out


def test_stale_run_directories_are_removed(engine: IOEngine, tmp_path) -> None:
    """A run dir left by a killed process is removed by the next store; a kept one is not."""
    for name, keep in (("tiermem-dead-1", False), ("tiermem-kept-2", True)):
        os.mkdir(tmp_path / name)
        (tmp_path / name / OWNER_FILE).write_text(json.dumps({"pid": 999999, "keep": keep}))
        (tmp_path / name / "LOCK").write_text("")
        (tmp_path / name / SWAP_FILE).write_bytes(b"\0" * 4096)
    os.mkdir(tmp_path / "user-data")  # not ours: never touched
    with SwapStore([str(tmp_path)], engine):
        assert not os.path.exists(tmp_path / "tiermem-dead-1")
        assert os.path.exists(tmp_path / "tiermem-kept-2")
        assert os.path.exists(tmp_path / "user-data")


def test_killed_process_leaves_a_run_dir_that_is_cleaned(tmp_path) -> None:
    """A store whose process is SIGKILLed is cleaned by the next one (its lock died with it)."""
    script = textwrap.dedent(f"""
        import os, signal
        from tiermem.io.engine import create_engine
        from tiermem.store import SwapStore
        s = SwapStore([{str(tmp_path)!r}], create_engine("threads"))
        print(s.run_dirs[0], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    left = res.stdout.strip()
    assert os.path.isdir(left)
    from tiermem.io.engine import create_engine

    with create_engine("threads") as eng, SwapStore([str(tmp_path)], eng):
        assert not os.path.exists(left)


def test_full_disk_is_a_clear_error_and_loses_nothing(engine: IOEngine, small_fs_dir: str) -> None:
    """On a full 16 MiB filesystem allocate raises StoreError naming the path and the fix; old data stays."""
    with SwapStore([small_fs_dir], engine) as store:
        first = store.allocate(4 << 20)
        data = _random(4 << 20, 8)
        store.write(first, data).wait()
        with pytest.raises(StoreError) as info:
            store.allocate(64 << 20)
        msg = str(info.value)
        assert small_fs_dir in msg and "no space" in msg and "nvme.paths" in msg
        out = np.zeros_like(data)
        store.read(first, out).wait()
        assert np.array_equal(out, data)
        store.allocate(2 << 20)  # still usable for what fits


def test_bad_paths_are_clear_errors(engine: IOEngine, tmp_path) -> None:
    """No paths, a path that is a file, and a bad stripe size each raise StoreError naming the key."""
    with pytest.raises(StoreError, match="nvme.paths: no swap directory"):
        SwapStore([], engine)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="nvme.paths: .*file"):
        SwapStore([str(tmp_path / "file")], engine)
    with pytest.raises(StoreError, match="nvme.stripe_size"):
        SwapStore([str(tmp_path)], engine, stripe_size=1000)


def test_store_on_a_filesystem_without_o_direct(engine: IOEngine, ramfs_dir: str) -> None:
    """A store on ramfs reports direct=False and still round-trips."""
    with SwapStore([ramfs_dir], engine) as store, AlignedBuffer(1 << 20) as buf:
        assert store.direct is False
        buf.numpy()[:] = _random(buf.nbytes, 2)
        ext = store.allocate(buf.nbytes)
        store.write(ext, buf.view).wait()
        out = np.zeros(buf.nbytes, dtype=np.uint8)
        store.read(ext, out).wait()
        assert np.array_equal(out, buf.numpy())
