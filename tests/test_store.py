"""The swap store: extents, striping across directories, run directories, locking, cleanup, full disks."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest

from tiermem.errors import StoreError
from tiermem.io.buffers import AlignedBuffer
from tiermem.io.engine import IOEngine, Piece
from tiermem.io.future import IOFuture
from tiermem.store import SwapStore
from tiermem.store.store import OWNER_FILE, RUN_PREFIX, SWAP_FILE


def _random(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.fixture
def ext4_dir(tmp_path) -> Iterator[str]:
    """A real 64 MiB ext4 filesystem on a loop device: there a failed fallocate keeps the blocks it got."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root")
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is not installed")
    image, target = tmp_path / "ext4.img", tmp_path / "ext4"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    target.mkdir()
    for cmd in (["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], ["mount", "-o", "loop", str(image), str(target)]):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"{cmd[0]} failed here: {res.stderr.strip()}")
    try:
        yield str(target)
    finally:
        if subprocess.run(["umount", str(target)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], check=False)


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


def test_weighted_striping_gives_each_directory_its_share_spread_through_the_period(engine: IOEngine,
                                                                                    tmp_path) -> None:
    """Weights 1:3 put 3 of every 4 chunks on the second directory, not bunched: the period is b a b b,
    each file holds its chunks in order, the data reads back whole and in any range, and the files are
    preallocated to exactly their share."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    stripe = 64 << 10
    with SwapStore(dirs, engine, stripe_size=stripe, weights=[1, 3]) as store:
        assert store.layout.slots == [(1, 0), (0, 0), (1, 1), (1, 2)]
        data = _random(9 * stripe + 1000, 4)  # 10 chunks: a period of 4 twice, and 2 more (b, a)
        ext = store.allocate(len(data))
        assert [f.size() for f in store.files] == [3 * stripe, 7 * stripe]
        store.write(ext, data).wait()
        raw = [np.fromfile(os.path.join(d, SWAP_FILE), dtype=np.uint8) for d in store.run_dirs]
        where = [(1, 0), (0, 0), (1, 1), (1, 2), (1, 3), (0, 1), (1, 4), (1, 5), (1, 6), (0, 2)]
        for k, (d, at) in enumerate(where):
            chunk = data[k * stripe:(k + 1) * stripe]
            assert np.array_equal(raw[d][at * stripe:at * stripe + len(chunk)], chunk), f"stripe chunk {k}"
        out = np.zeros_like(data)
        store.read(ext, out).wait()
        assert np.array_equal(out, data)
        part = np.zeros(5 * stripe + 4096, dtype=np.uint8)
        store.read(ext, part, len(part), offset=3 * stripe - 4096).wait()
        assert np.array_equal(part, data[3 * stripe - 4096:3 * stripe - 4096 + len(part)])
        # b's slots 2 and 3 of a period follow each other in its file and in the buffer: one piece
        pieces = store.pieces(ext, 4 * stripe)
        assert [(p.file is store.files[1], p.length // stripe) for p in pieces] == [(True, 1), (False, 1), (True, 2)]


def test_a_reopened_run_must_keep_its_striping(engine: IOEngine, tmp_path) -> None:
    """Kept swap files written with one layout are refused under another, naming both and the keys."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    with SwapStore(dirs, engine, stripe_size=64 << 10, weights=[1, 2], keep_files=True, run_name="kept"):
        pass
    with pytest.raises(StoreError, match=r"weights \[1, 2\].*nvme.path_weights"):
        SwapStore(dirs, engine, stripe_size=64 << 10, run_name="kept")
    with SwapStore(dirs, engine, stripe_size=64 << 10, weights=[1, 2], run_name="kept") as again:
        assert again.layout.weights == (1, 2)
    with pytest.raises(StoreError, match="nvme.path_weights: 1 weights for 2 directories"):
        SwapStore(dirs, engine, weights=[1])


def test_a_striped_read_or_write_is_one_engine_request(engine: IOEngine, tmp_path, monkeypatch) -> None:
    """A range striped over three directories goes to the engine as one request of many pieces (one future),
    each piece in its directory's file."""
    dirs = [str(tmp_path / d) for d in "abc"]
    stripe = 64 << 10
    requests: list[list[Piece]] = []
    real_start = engine._start

    def counting_start(op: int, view: memoryview, address: int, pieces: list[Piece]) -> IOFuture:
        requests.append(pieces)
        return real_start(op, view, address, pieces)

    monkeypatch.setattr(engine, "_start", counting_start)
    with SwapStore(dirs, engine, stripe_size=stripe) as store:
        data = _random(10 * stripe + 123, 9)
        ext = store.allocate(len(data))
        store.write(ext, data).wait()
        out = np.zeros_like(data)
        store.read(ext, out).wait()
        assert np.array_equal(out, data)
        assert len(requests) == 2 and all(len(r) == 11 for r in requests)
        assert {p.file.path for p in requests[0]} == {f.path for f in store.files}


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
            from tiermem.io.backends import create_engine
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
        from tiermem.io.backends import create_engine
        from tiermem.store import SwapStore
        s = SwapStore([{str(tmp_path)!r}], create_engine("threads"))
        print(s.run_dirs[0], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    left = res.stdout.strip()
    assert os.path.isdir(left)
    from tiermem.io.backends import create_engine

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


def test_run_dir_swapped_for_a_symlink_after_mkdir_is_refused(engine: IOEngine, tmp_path, monkeypatch) -> None:
    """A run dir replaced by a symlink between mkdir and use is refused; nothing lands at the link's target."""
    base, target = tmp_path / "base", tmp_path / "target"
    base.mkdir(mode=0o700)
    target.mkdir(mode=0o755)
    real_mkdir = os.mkdir

    def racing_mkdir(path, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        real_mkdir(path, mode, dir_fd=dir_fd)
        if os.path.basename(os.fspath(path)).startswith(RUN_PREFIX):  # the attacker wins the race
            os.rmdir(path, dir_fd=dir_fd)
            os.symlink(target, path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    with pytest.raises(StoreError, match="symlink"):
        SwapStore([str(base)], engine)
    assert os.listdir(target) == []
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755


def test_run_name_planted_as_a_symlink_is_refused(engine: IOEngine, tmp_path) -> None:
    """A run_name that is a symlink to another directory is refused; the target is neither chmodded nor written."""
    base, target = tmp_path / "base", tmp_path / "target"
    base.mkdir(mode=0o700)
    target.mkdir(mode=0o755)
    (base / "kept").symlink_to(target)
    with pytest.raises(StoreError, match="symlink"):
        SwapStore([str(base)], engine, run_name="kept")
    assert os.listdir(target) == []
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755


@pytest.mark.parametrize("mode, group", [(0o777, None), (0o770, 65534)])
def test_base_writable_by_others_without_sticky_bit_is_refused(engine: IOEngine, tmp_path, mode: int,
                                                               group: int | None) -> None:
    """A base others (or another group) may write without the sticky bit is refused, naming it and the fix;
    with +t it is used."""
    base = tmp_path / "open"
    base.mkdir()
    if group is not None:
        if os.geteuid() != 0:
            pytest.skip("chgrp to another group needs root")
        os.chown(base, -1, group)
    os.chmod(base, mode)
    with pytest.raises(StoreError) as info:
        SwapStore([str(base)], engine)
    msg = str(info.value)
    assert str(base) in msg and "chmod" in msg
    assert os.listdir(base) == []
    os.chmod(base, mode | stat.S_ISVTX)
    with SwapStore([str(base)], engine) as store:
        store.allocate(4096)


def test_base_writable_by_the_users_private_group_is_used(engine: IOEngine, tmp_path) -> None:
    """A base writable by the user's own private group (umask 002 on Debian) is accepted."""
    import grp
    import pwd

    user, group = pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(os.getegid())
    if group.gr_name != user or set(group.gr_mem) - {user}:
        pytest.skip(f"this user's group {group.gr_name!r} is not a private group of {user!r}")
    base = tmp_path / "mine"
    base.mkdir()
    os.chmod(base, 0o770)
    with SwapStore([str(base)], engine) as store:
        store.allocate(4096)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_base_owned_by_another_user_is_refused(engine: IOEngine, tmp_path) -> None:
    """A base owned by another uid (65534) is refused, naming the path and the owner; nothing is created in it."""
    base = tmp_path / "theirs"
    base.mkdir(mode=0o755)
    os.chown(base, 65534, 65534)
    with pytest.raises(StoreError) as info:
        SwapStore([str(base)], engine)
    msg = str(info.value)
    assert str(base) in msg and "65534" in msg
    assert os.listdir(base) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="a symlink of another user needs root (lchown)")
def test_base_that_is_another_users_symlink_is_refused(engine: IOEngine, tmp_path) -> None:
    """A base that is a symlink planted by another uid (as in /var/tmp) is refused even if it points at ours."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "tiermem-base"
    link.symlink_to(mine)
    os.lchown(link, 65534, 65534)
    with pytest.raises(StoreError) as info:
        SwapStore([str(link)], engine)
    msg = str(info.value)
    assert str(link) in msg and "symlink" in msg and "65534" in msg
    assert os.listdir(mine) == []
    os.lchown(link, 0, 0)  # the same link made by this user (or root) is the user's own choice
    with SwapStore([str(link)], engine) as store:
        assert os.listdir(mine) == [os.path.basename(store.run_dirs[0])]


def test_created_directories_are_private(engine: IOEngine, tmp_path) -> None:
    """Every directory the store creates (missing parents of the base included) is 0700, even under umask 0."""
    old = os.umask(0)
    try:
        with SwapStore([str(tmp_path / "a" / "b" / "c")], engine) as store:
            for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c", store.run_dirs[0]):
                assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    finally:
        os.umask(old)


def _fake_dead_run(d, keep: bool = False) -> None:  # type: ignore[no-untyped-def]
    os.makedirs(d, exist_ok=True)
    (d / OWNER_FILE).write_text(json.dumps({"pid": 999999, "keep": keep}))
    (d / "LOCK").write_text("")
    (d / SWAP_FILE).write_bytes(b"\0" * 4096)


def test_stale_cleanup_follows_no_symlink_and_spares_other_users(engine: IOEngine, tmp_path) -> None:
    """Cleanup removes our dead runs only: not another uid's, not through a symlinked run or an entry in one."""
    victim, victim2 = tmp_path / "victim", tmp_path / "victim2"
    _fake_dead_run(victim)
    victim2.mkdir()
    (victim2 / "precious").write_text("x")
    (tmp_path / f"{RUN_PREFIX}link-1").symlink_to(victim)
    _fake_dead_run(tmp_path / f"{RUN_PREFIX}dead-2")
    (tmp_path / f"{RUN_PREFIX}dead-2" / "sub").symlink_to(victim2)
    other = tmp_path / f"{RUN_PREFIX}other-3"
    _fake_dead_run(other)
    if os.geteuid() == 0:
        for p in (other, *other.iterdir()):
            os.chown(p, 65534, 65534)
    with SwapStore([str(tmp_path)], engine):
        assert sorted(os.listdir(victim)) == sorted([OWNER_FILE, "LOCK", SWAP_FILE])
        assert (victim2 / "precious").read_text() == "x"
        assert not os.path.lexists(tmp_path / f"{RUN_PREFIX}dead-2")
        if os.geteuid() == 0:
            assert sorted(os.listdir(other)) == sorted([OWNER_FILE, "LOCK", SWAP_FILE])


@pytest.mark.parametrize("fs", ["small_fs_dir", "ext4_dir"])
def test_asking_for_more_than_is_free_keeps_the_free_space(engine: IOEngine, fs: str, request) -> None:
    """Asking for more than is free raises StoreError naming needed and free bytes and takes no space."""
    base = request.getfixturevalue(fs)
    with SwapStore([base], engine) as store:
        first = store.allocate(4 << 20)
        data = _random(4 << 20, 9)
        store.write(first, data).wait()
        free = _free_bytes(base)
        ask = free + (1 << 20)  # more than is free, less than the filesystem holds
        needed = -(-ask // store.stripe_size) * store.stripe_size
        with pytest.raises(StoreError) as info:
            store.allocate(ask)
        msg = str(info.value)
        assert base in msg and f"{needed} bytes" in msg and f"{free} bytes" in msg
        assert abs(_free_bytes(base) - free) <= 4 * 4096
        assert os.path.getsize(os.path.join(store.run_dirs[0], SWAP_FILE)) == 4 << 20
        out = np.zeros_like(data)
        store.read(first, out).wait()
        assert np.array_equal(out, data)


def test_allocation_on_a_nearly_full_filesystem_takes_only_what_it_needs(engine: IOEngine, ext4_dir: str) -> None:
    """On ext4 with less free than a growth step, allocating 4 MiB reserves 4 MiB, not the disk's free space."""
    with SwapStore([ext4_dir], engine) as store:
        free = _free_bytes(ext4_dir)
        store.allocate(4 << 20)
        assert os.path.getsize(os.path.join(store.run_dirs[0], SWAP_FILE)) == 4 << 20
        assert free - _free_bytes(ext4_dir) <= (4 << 20) + (64 << 10)  # the blocks plus a little metadata


def test_failed_preallocation_gives_back_what_it_got(engine: IOEngine, small_fs_dir: str, monkeypatch) -> None:
    """A preallocation failing part way (on the second of two directories) gives every block back."""
    dirs = [os.path.join(small_fs_dir, "a"), os.path.join(small_fs_dir, "b")]
    with SwapStore(dirs, engine, stripe_size=64 << 10) as store:
        store.allocate(1 << 20)
        swaps = [os.path.join(d, SWAP_FILE) for d in store.run_dirs]
        sizes, free = [os.path.getsize(p) for p in swaps], _free_bytes(small_fs_dir)
        second = os.fstat(store.files[1].buffered_fd).st_ino
        real = os.posix_fallocate

        def partial(fd: int, offset: int, length: int) -> None:
            if os.fstat(fd).st_ino == second:  # a disk filling up under us: half of it, then ENOSPC
                real(fd, offset, length // 2)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", partial)
        with pytest.raises(StoreError, match="no space"):
            store.allocate(4 << 20)
        assert abs(_free_bytes(small_fs_dir) - free) <= 4 * 4096
        assert [os.path.getsize(p) for p in swaps] == sizes
        monkeypatch.undo()
        store.allocate(4 << 20)  # the store is still usable


def test_weights_for_drives_of_different_speeds_finish_a_transfer_together() -> None:
    """The weights `auto` derives from bandwidths: equal drives equal, and for unequal ones a transfer's time
    (the slowest drive's share over its speed) within 4% of the ideal split, with at most 12 chunks a period."""
    from tiermem.io.bandwidth import MAX_PERIOD, weights_for

    assert weights_for([2.0, 2.0]) == (1, 1) and weights_for([1.0, 1.0, 1.0]) == (1, 1, 1)
    assert weights_for([1.0, 3.0]) == (1, 3)
    for gbps in ([2.35, 7.62], [1.0, 2.0, 5.0], [3.2, 1.1]):
        w = weights_for(gbps)
        seconds = max(wi / sum(w) / g for wi, g in zip(w, gbps, strict=True))
        assert sum(w) <= MAX_PERIOD and seconds <= 1.04 / sum(gbps), (gbps, w)
    assert weights_for([1.0, 100.0]) == (1, 12)  # the period is capped; the slow drive still gets a chunk
