"""SwapStore: extents in preallocated swap files, striped across directories, in a locked run directory.

# [Note: striping]
The store offers one logical byte space. It is cut into stripe_size chunks dealt round-robin over the
directories (RAID0 in software): chunk k lives in directory k % n at file offset (k // n) * stripe_size.
An extent is a 4 KiB-aligned range of that space; reading it issues one request per directory run of
consecutive chunks, so n drives are busy at once and requests stay as large as the layout allows.

# [Note: run directories]
Each store lives in `<path>/tiermem-<host>-<pid>-<token>/` (mode 0700) on every path, holding `swap.bin`
(mode 0600), `owner.json` and `LOCK`. The lock (flock) is held for the store's life, so no two processes
share a run directory. On start, run directories of ours whose lock is free and which were not kept are
left-overs of a killed process and are removed. On close the files are removed unless `keep_files`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from tiermem.errors import StoreError
from tiermem.freelist import FreeList
from tiermem.io.buffers import ALIGN, align_up, as_bytes_view
from tiermem.io.engine import IOEngine
from tiermem.io.files import IOFile
from tiermem.io.future import IOFuture, gather
from tiermem.sizes import format_size

log = logging.getLogger(__name__)

RUN_PREFIX = "tiermem-"
OWNER_FILE = "owner.json"
LOCK_FILE = "LOCK"
SWAP_FILE = "swap.bin"
GROW_STEP = 64 << 20  # files grow by at least this much, so fallocate is not called per extent


@dataclass(frozen=True)
class Extent:
    """A place in the store: `nbytes` of data at logical offset `start` (4 KiB-aligned, `size` reserved)."""

    start: int
    size: int
    nbytes: int


class SwapStore:
    """Swap files on one or more directories, striped; a context manager.

    Args:
        paths: directories to put swap files in (created if missing). Several are striped.
        engine: the I/O engine that moves the bytes.
        stripe_size: bytes per stripe chunk, a multiple of 4096.
        keep_files: leave the run directory and its files on close (a later run can reopen it by name).
        run_name: reuse or create this run directory name instead of a fresh one.
        direct: open swap files with O_DIRECT (falls back per directory when refused).

    Example::

        with create_engine() as engine, SwapStore(["/mnt/nvme0", "/mnt/nvme1"], engine) as store:
            ext = store.allocate(buf.nbytes)
            store.write(ext, buf).wait()
            store.read(ext, out).wait()
    """

    def __init__(self, paths: list[str] | tuple[str, ...], engine: IOEngine, *, stripe_size: int = 1 << 20,
                 keep_files: bool = False, run_name: str | None = None, direct: bool = True) -> None:
        if not paths:
            raise StoreError("nvme.paths: no swap directory given; list at least one directory")
        if stripe_size <= 0 or stripe_size % ALIGN:
            raise StoreError(f"nvme.stripe_size: expected a positive multiple of 4096, got {stripe_size}")
        self.engine = engine
        self.stripe_size = stripe_size
        self.keep_files = keep_files
        self.closed = False
        self._lock = threading.Lock()
        self._free = FreeList()  # holes below `_end`
        self._end = 0  # logical bytes handed out so far (the high-water mark)
        self._file_sizes: list[int] = []  # bytes preallocated in each swap file
        self.used = 0  # logical bytes in live extents
        self.peak = 0  # most bytes in live extents at once (the swapper resets it with its stats)
        self.run_dirs: list[str] = []  # one per path, in path order
        self.files: list[IOFile] = []  # the swap file in each run directory
        self._lock_fds: list[int] = []  # flock holders, one per run directory
        name = run_name or f"{RUN_PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        if os.sep in name or name in (".", ".."):
            raise StoreError(f"run_name: {name!r} must be a plain directory name")
        try:
            for base in paths:
                self._open_run_dir(os.path.abspath(os.path.expanduser(base)), name, direct)
        except BaseException:
            self._release(remove=run_name is None)
            raise
        self.direct = all(f.direct for f in self.files)  # False if any directory refused O_DIRECT
        self._finalizer = weakref.finalize(self, _cleanup_at_exit, list(self.run_dirs), keep_files)
        log.info("swap store in %s (stripe %s, %s)", ", ".join(self.run_dirs), format_size(stripe_size),
                 "O_DIRECT" if self.direct else "buffered I/O")

    # -- set-up and tear-down -------------------------------------------------------------------
    def _open_run_dir(self, base: str, name: str, direct: bool) -> None:
        try:
            os.makedirs(base, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"nvme.paths: cannot create swap directory {base}: {exc.strerror}; "
                             "choose a writable directory") from None
        if not os.path.isdir(base):
            raise StoreError(f"nvme.paths: {base} is not a directory; choose a directory for swap files")
        if not os.access(base, os.W_OK | os.X_OK):
            raise StoreError(f"nvme.paths: {base} is not writable by this user; choose a writable directory "
                             "or fix its permissions")
        _remove_stale_runs(base)
        run_dir = os.path.join(base, name)
        try:
            os.mkdir(run_dir, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StoreError(f"nvme.paths: cannot create run directory {run_dir}: {exc.strerror}") from None
        os.chmod(run_dir, 0o700)
        lock_fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            owner = _read_owner(run_dir)
            raise StoreError(
                f"{run_dir} is in use by another process (pid {owner.get('pid', '?')}); stop it or use "
                "another run name"
            ) from None
        self._lock_fds.append(lock_fd)
        self.run_dirs.append(run_dir)
        with open(os.path.join(run_dir, OWNER_FILE), "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                       "keep": self.keep_files}, f)
        swap = IOFile(os.path.join(run_dir, SWAP_FILE), "rw", direct=direct)
        self.files.append(swap)
        self._file_sizes.append(swap.size())

    def close(self) -> None:
        """Release the lock and remove the swap files (unless keep_files). In-flight I/O must be done."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        self._release(remove=not self.keep_files)

    def _release(self, *, remove: bool) -> None:
        for f in self.files:
            f.close()
        for fd in self._lock_fds:
            os.close(fd)
        if remove:
            for d in self.run_dirs:
                shutil.rmtree(d, ignore_errors=True)
        self.files, self._lock_fds = [], []

    def __enter__(self) -> SwapStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- space ----------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Extent:
        """Reserve room for `nbytes` (rounded up to 4 KiB); raises StoreError when a disk is full."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = align_up(max(nbytes, 1))
        with self._lock:
            start = self._free.take(size)
            if start is None:
                start = self._end
                self._grow(start + size)
                self._end = start + size
            self.used += size
            self.peak = max(self.peak, self.used)
            return Extent(start, size, nbytes)

    def free(self, extent: Extent) -> None:
        """Give an extent's room back for reuse (its bytes are not erased)."""
        with self._lock:
            self._free.give(extent.start, extent.size)
            self.used -= extent.size

    def _grow(self, logical_end: int) -> None:
        """Preallocate every file far enough to hold logical bytes [0, logical_end)."""
        n = len(self.files)
        chunks = (logical_end + self.stripe_size - 1) // self.stripe_size
        for d, f in enumerate(self.files):
            mine = chunks // n + (1 if d < chunks % n else 0)  # stripe chunks that land in file d
            need = mine * self.stripe_size
            have = self._file_sizes[d]
            if need <= have:
                continue
            target = max(need, min(have + GROW_STEP, need + GROW_STEP))
            try:
                f.allocate(have, target - have)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise StoreError(f"{f.path}: cannot preallocate swap space: {exc.strerror}") from None
                try:
                    f.allocate(have, need - have)  # the step was greedy; try the exact need
                    target = need
                except OSError:
                    free = shutil.disk_usage(os.path.dirname(f.path)).free
                    raise StoreError(
                        f"{f.path}: no space for {format_size(need - have)} more swap "
                        f"({format_size(free)} free on that filesystem); free some space, add a directory "
                        "on another drive to nvme.paths, or offload less"
                    ) from None
            self._file_sizes[d] = target

    # -- data -----------------------------------------------------------------------------------
    def pieces(self, extent: Extent, nbytes: int | None = None, offset: int = 0) -> list[tuple[int, int, int, int]]:
        """(file index, file offset, length, offset in the caller's buffer) runs covering `nbytes` of the
        extent from `offset` on."""
        nbytes = extent.size - offset if nbytes is None else nbytes
        n, ss = len(self.files), self.stripe_size
        runs: list[tuple[int, int, int, int]] = []
        pos = 0
        while pos < nbytes:
            logical = extent.start + offset + pos
            k, within = divmod(logical, ss)
            length = min(ss - within, nbytes - pos)
            d, file_off = k % n, (k // n) * ss + within
            if runs and runs[-1][0] == d and runs[-1][1] + runs[-1][2] == file_off and n == 1:
                last = runs[-1]
                runs[-1] = (d, last[1], last[2] + length, last[3])
            else:
                runs.append((d, file_off, length, pos))
            pos += length
        return runs

    def write(self, extent: Extent, buf: Any, nbytes: int | None = None, offset: int = 0) -> IOFuture:
        """Write the first `nbytes` (default extent.nbytes) of `buf` into the extent, `offset` bytes in."""
        return self._io(extent, buf, nbytes, offset, write=True)

    def read(self, extent: Extent, buf: Any, nbytes: int | None = None, offset: int = 0) -> IOFuture:
        """Read `nbytes` (default extent.nbytes) of the extent from `offset` on into the start of `buf`."""
        return self._io(extent, buf, nbytes, offset, write=False)

    def _io(self, extent: Extent, buf: Any, nbytes: int | None, offset: int, *, write: bool) -> IOFuture:
        if self.closed:
            raise StoreError("the swap store is closed")
        nbytes = extent.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or nbytes < 0 or offset + nbytes > extent.size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) do not fit an extent of {extent.size}")
        view = as_bytes_view(buf)
        if len(view) < nbytes:
            raise ValueError(f"the buffer holds {len(view)} bytes, the transfer needs {nbytes}")
        op = self.engine.write if write else self.engine.read
        futures = [op(self.files[d], view[boff : boff + length], off) for d, off, length, boff in
                   self.pieces(extent, nbytes, offset)]
        return futures[0] if len(futures) == 1 else gather(futures)

    def flush(self) -> None:
        """fsync every swap file (data that must survive a crash, e.g. kept files)."""
        for f in self.files:
            os.fsync(f.buffered_fd)


def _read_owner(run_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(run_dir, OWNER_FILE), encoding="utf-8") as f:
            data = json.load(f)
            return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _remove_stale_runs(base: str) -> None:
    """Remove run directories of ours whose owner is gone and which were not kept."""
    try:
        entries = os.listdir(base)
    except OSError:
        return
    for entry in entries:
        run_dir = os.path.join(base, entry)
        if not entry.startswith(RUN_PREFIX) or not os.path.isfile(os.path.join(run_dir, OWNER_FILE)):
            continue
        owner = _read_owner(run_dir)
        if owner.get("keep", True):
            continue
        try:
            fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(run_dir, ignore_errors=True)  # removed while we hold its lock
        except BlockingIOError:
            continue  # alive: its owner holds the lock
        finally:
            os.close(fd)
        log.info("removed stale swap run directory %s left by pid %s", run_dir, owner.get("pid", "?"))


def _cleanup_at_exit(run_dirs: list[str], keep: bool) -> None:
    if not keep:
        for d in run_dirs:
            shutil.rmtree(d, ignore_errors=True)

