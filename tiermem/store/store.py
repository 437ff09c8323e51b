"""SwapStore: extents in preallocated swap files, striped across directories, in a locked run directory.

# [Note: striping]
The store offers one logical byte space. It is cut into stripe_size chunks dealt over the directories
(RAID0 in software), in proportion to each directory's weight, so that a drive twice as fast carries twice
the chunks of every extent and the drives finish a transfer together: with weights w (equal by default,
or `nvme.path_weights`), a period of P = sum(w) chunks gives directory d w[d] of its slots, spread through
the period rather than bunched (slot order sorts (j + 1/2) / w[d] over every d and j < w[d]). Chunk k is
slot k % P of period k // P; if that slot is directory d's j-th, the chunk lives in d's file at offset
((k // P) * w[d] + j) * stripe_size. Equal weights give plain round-robin: chunk k in directory k % n at
(k // n) * stripe_size. An extent is a 4 KiB-aligned range of that space. Reading or writing it is one
engine request (one future) whose pieces are the stripe chunks it touches, each in its directory's file,
so every drive is busy at once. Pieces merge where they are consecutive both in a file and in the
caller's buffer: with one directory the whole range is one piece, and with weights a directory's
neighbouring slots of one period merge.

# [Note: run directories]
Each store lives in `<path>/tiermem-<host>-<pid>-<token>/` (mode 0700) on every path, holding `swap.bin`
(mode 0600), `owner.json` and `LOCK`. The lock (flock) is held for the store's life, so no two processes
share a run directory. On start, run directories of ours whose lock is free and which were not kept are
left-overs of a killed process and are removed. On close the files are removed unless `keep_files`.

The default path sits under /var/tmp, which every user may write, so whoever can write a directory on the
way could swap the run directory for a symlink between our mkdir and our use of it and have the chmod, the
lock and the swap file land elsewhere. Hence: each path is opened once as a directory descriptor (missing
parts created 0700 one at a time, each opened without following a symlink) and refused unless it belongs
to this user or root and no one else may write it (the user's private group aside; the sticky bit, as on
/tmp, makes others' write access harmless: they cannot rename or remove our entries). Everything below it
is created, opened, chmodded and removed relative to descriptors, with O_NOFOLLOW, so a symlink put in
place of an entry is refused or removed, never followed. Left-overs of other users are never touched.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import json
import logging
import os
import pwd
import secrets
import socket
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from tiermem.errors import StoreError
from tiermem.freelist import FreeList
from tiermem.io.buffers import align_up, as_bytes_view, check_io_size
from tiermem.io.engine import IOEngine, Piece
from tiermem.io.files import IOFile
from tiermem.io.future import IOFuture
from tiermem.sizes import format_size

log = logging.getLogger(__name__)

RUN_PREFIX = "tiermem-"
OWNER_FILE = "owner.json"
LOCK_FILE = "LOCK"
SWAP_FILE = "swap.bin"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_DIR = _DIR_FLAGS | os.O_NOFOLLOW  # an entry we made: a symlink there is someone else's doing
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass(frozen=True)
class Extent:
    """A place in the store: `nbytes` of data at logical offset `start` (4 KiB-aligned, `size` reserved)."""

    start: int
    size: int
    nbytes: int


class StripeLayout:
    """Where each stripe chunk of the logical space lives: see [Note: striping]."""

    def __init__(self, stripe_size: int, weights: list[int] | tuple[int, ...]) -> None:
        if not weights or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in weights):
            raise StoreError(f"nvme.path_weights: expected a positive integer per directory, got {list(weights)}")
        self.stripe_size = stripe_size
        self.weights = tuple(weights)
        self.period = sum(weights)
        order = sorted(((j + 0.5) / w, d, j) for d, w in enumerate(weights) for j in range(w))
        self.slots = [(d, j) for _, d, j in order]  # slot -> (directory, its index among d's slots)

    def place(self, chunk: int) -> tuple[int, int]:
        """(directory, chunk index within that directory's file) of logical chunk `chunk`."""
        q, r = divmod(chunk, self.period)
        d, j = self.slots[r]
        return d, q * self.weights[d] + j

    def chunks_per_dir(self, chunks: int) -> list[int]:
        """How many of the first `chunks` logical chunks each directory holds."""
        q, r = divmod(chunks, self.period)
        mine = [q * w for w in self.weights]
        for d, _ in self.slots[:r]:
            mine[d] += 1
        return mine

    def bytes_per_dir(self, logical_end: int) -> list[int]:
        """Bytes each directory's file needs to hold logical bytes [0, logical_end)."""
        chunks = -(-logical_end // self.stripe_size)
        return [c * self.stripe_size for c in self.chunks_per_dir(chunks)]


class SwapStore:
    """Swap files on one or more directories, striped; a context manager.

    Args:
        paths: directories to put swap files in (created 0700 if missing). Several are striped. Each must
            belong to this user (or root) and be writable by no one else (the user's private group aside)
            unless it has the sticky bit.
        engine: the I/O engine that moves the bytes.
        stripe_size: bytes per stripe chunk, a multiple of 4096.
        weights: stripe chunks per period for each directory (default equal): see [Note: striping].
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
                 weights: list[int] | tuple[int, ...] | None = None, keep_files: bool = False,
                 run_name: str | None = None, direct: bool = True) -> None:
        if not paths:
            raise StoreError("nvme.paths: no swap directory given; list at least one directory")
        check_io_size("nvme.stripe_size", stripe_size, StoreError)
        if weights is not None and len(weights) != len(paths):
            raise StoreError(f"nvme.path_weights: {len(weights)} weights for {len(paths)} directories; give one "
                             "per nvme.paths entry")
        self.engine = engine
        self.stripe_size = stripe_size
        self.layout = StripeLayout(stripe_size, weights or [1] * len(paths))
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
        # (path's descriptor, run directory's descriptor) per path: every name is resolved from these, never
        # from a path string again ([Note: run directories]); shared with the finalizer, so changed in place
        self._dir_fds: list[tuple[int, int]] = []
        name = run_name or f"{RUN_PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        if os.sep in name or name in (".", ".."):
            raise StoreError(f"run_name: {name!r} must be a plain directory name")
        self._name = name  # the run directory's name under every path
        try:
            for base in paths:
                self._open_run_dir(os.path.abspath(os.path.expanduser(base)), name, direct)
        except BaseException:
            self._release(remove=run_name is None)
            raise
        self.direct = all(f.direct for f in self.files)  # False if any directory refused O_DIRECT
        self._finalizer = weakref.finalize(self, _cleanup_at_exit, self._dir_fds, name, keep_files)
        log.info("swap store in %s (stripe %s%s, %s)", ", ".join(self.run_dirs), format_size(stripe_size),
                 f", weights {':'.join(map(str, self.layout.weights))}" if len(paths) > 1 else "",
                 "O_DIRECT" if self.direct else "buffered I/O")

    # -- set-up and tear-down -------------------------------------------------------------------
    def _open_run_dir(self, base: str, name: str, direct: bool) -> None:
        base_fd = _open_base(base)
        run_fd, created = -1, False
        run_dir = os.path.join(base, name)
        try:
            _check_base(base, base_fd)
            _remove_stale_runs(base, base_fd)
            run_fd, created = _make_run_dir(base, base_fd, name)
            lock_fd = _open_file(run_fd, LOCK_FILE, os.O_RDWR | os.O_CREAT, run_dir)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock_fd)
                owner = _read_owner(run_fd)
                raise StoreError(
                    f"{run_dir} is in use by another process (pid {owner.get('pid', '?')}); stop it or use "
                    "another run name"
                ) from None
        except BaseException:
            if created:  # ours alone: nothing else can be in it yet
                _remove_run(base_fd, run_fd, name)
            for fd in (run_fd, base_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        # Registered only once locked: from here a failure's clean-up removes this run directory.
        self._lock_fds.append(lock_fd)
        self._dir_fds.append((base_fd, run_fd))
        self.run_dirs.append(run_dir)
        layout = {"stripe_size": self.stripe_size, "weights": list(self.layout.weights)}
        before = _read_owner(run_fd)  # a reopened run's, whose data is laid out as it says
        if "weights" in before and {k: before.get(k) for k in layout} != layout:
            raise StoreError(
                f"{run_dir} holds swap data striped with stripe size {before.get('stripe_size')} and weights "
                f"{before.get('weights')}, not {self.stripe_size} and {list(self.layout.weights)}; reopen it with "
                "the nvme.stripe_size and nvme.path_weights it was written with"
            )
        try:
            os.unlink(OWNER_FILE, dir_fd=run_fd)  # made afresh with O_EXCL below
        except FileNotFoundError:
            pass
        fd = _open_file(run_fd, OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, run_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                       "keep": self.keep_files, **layout}, f)
        swap = IOFile(os.path.join(run_dir, SWAP_FILE), "rw", direct=direct, dir_fd=run_fd)
        self.files.append(swap)
        st = os.fstat(swap.buffered_fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise StoreError(f"{swap.path} is not a regular file of this user; remove it or use another run name")
        self._file_sizes.append(st.st_size)

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
        if remove:  # while the locks are held, so no other store takes these for left-overs meanwhile
            for base_fd, run_fd in self._dir_fds:
                _remove_run(base_fd, run_fd, self._name)
        for fd in self._lock_fds:
            os.close(fd)
        _close_dir_fds(self._dir_fds)
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
        """Preallocate every file to exactly what logical bytes [0, logical_end) need. Free space is checked
        first, and a failure gives back all this call reserved: a full disk keeps its free space."""
        grow: list[tuple[int, int, int]] = []  # (file index, its size now, the size it needs)
        for d, need in enumerate(self.layout.bytes_per_dir(logical_end)):
            have = self._file_sizes[d]
            if need > have:
                grow.append((d, have, need))
        if not grow:
            return
        self._check_free(grow)
        done: list[tuple[int, int, int]] = []
        try:
            for d, have, need in grow:
                done.append((d, have, need))  # before the call: a failed fallocate may keep what it got
                self.files[d].allocate(have, need - have)
        except OSError as exc:
            for d, have, need in done:
                self._give_back(d, have, need)
            d = done[-1][0]
            if exc.errno in _NO_SPACE:
                raise self._no_space(d, sum(need - have for _, have, need in grow), _free_bytes(self.files[d]),
                                     exc.strerror) from None
            raise StoreError(f"{self.files[d].path}: cannot preallocate swap space: {exc.strerror}") from None
        for d, _, need in grow:
            self._file_sizes[d] = need

    def _check_free(self, grow: list[tuple[int, int, int]]) -> None:
        """Raise StoreError, before reserving anything, when a filesystem has less free than its files need."""
        needed: dict[int, tuple[int, int]] = {}  # device -> (first file index on it, bytes its files need)
        for d, have, need in grow:
            dev = os.fstat(self.files[d].buffered_fd).st_dev
            first, total = needed.get(dev, (d, 0))
            needed[dev] = (first, total + need - have)
        for d, total in needed.values():
            free = _free_bytes(self.files[d])
            if free is not None and total > free:
                raise self._no_space(d, total, free)

    def _give_back(self, d: int, have: int, need: int) -> None:
        """Shrink file d back to `have` bytes, freeing every block a (failed) preallocation added."""
        f = self.files[d]
        try:
            # Up first, so the shrink really is one: blocks a failed fallocate left past the size it set
            # (some filesystems keep them there) are freed with the rest.
            os.ftruncate(f.buffered_fd, max(need, os.fstat(f.buffered_fd).st_size))
            os.ftruncate(f.buffered_fd, have)
        except OSError as exc:
            log.warning("%s: cannot give back swap space beyond %d bytes: %s", f.path, have, exc.strerror)

    def _no_space(self, d: int, needed: int, free: int | None, reason: str | None = None) -> StoreError:
        have = "no free space figure" if free is None else f"{free} bytes ({format_size(free)}) free"
        why = f" ({reason})" if reason else ""
        return StoreError(
            f"{self.files[d].path}: no space for {needed} bytes ({format_size(needed)}) more swap, {have} on that "
            f"filesystem{why}; free some space, add a directory on another drive to nvme.paths, or offload less"
        )

    # -- data -----------------------------------------------------------------------------------
    def pieces(self, extent: Extent, nbytes: int | None = None, offset: int = 0) -> list[Piece]:
        """The engine pieces (file, file offset, length, offset in the caller's buffer) covering `nbytes` of
        the extent from `offset` on; see [Note: striping]."""
        nbytes = extent.size - offset if nbytes is None else nbytes
        if len(self.files) == 1:  # logical offsets are the file's own: one piece
            return [Piece(self.files[0], extent.start + offset, nbytes, 0)] if nbytes else []
        ss = self.stripe_size
        pieces: list[Piece] = []
        pos = 0
        while pos < nbytes:  # one piece per stripe chunk, merged with the last where they are consecutive
            k, within = divmod(extent.start + offset + pos, ss)
            length = min(ss - within, nbytes - pos)
            d, at = self.layout.place(k)
            f, where = self.files[d], at * ss + within
            last = pieces[-1] if pieces else None
            if last is not None and last.file is f and last.offset + last.length == where:
                pieces[-1] = Piece(f, last.offset, last.length + length, last.buf_offset)
            else:
                pieces.append(Piece(f, where, length, pos))
            pos += length
        return pieces

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
        pieces = self.pieces(extent, nbytes, offset)
        # one request and one future for all of it, whatever the striping cut it into
        return self.engine.write_pieces(view, pieces) if write else self.engine.read_pieces(view, pieces)

    def flush(self) -> None:
        """fsync every swap file (data that must survive a crash, e.g. kept files)."""
        for f in self.files:
            os.fsync(f.buffered_fd)


def _free_bytes(f: IOFile) -> int | None:
    """Bytes free to unprivileged users on f's filesystem (swap stays out of root's reserve); None where the
    filesystem reports no capacity at all (ramfs, some FUSE mounts), so only fallocate can tell."""
    st = os.fstatvfs(f.buffered_fd)
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def _open_base(base: str) -> int:
    """A directory descriptor for `base`, creating its missing parts 0700 one at a time, none through a
    symlink. Existing parts are the user's choice and may be symlinks (see _open_existing_dir)."""
    missing: list[str] = []
    path = base
    while True:
        try:
            fd = _open_existing_dir(path)
            break
        except FileNotFoundError:
            parent, leaf = os.path.split(path)
            if not leaf or parent == path:
                raise StoreError(f"nvme.paths: cannot open swap directory {base}; choose an existing one") from None
            missing.append(leaf)
            path = parent
        except NotADirectoryError:
            raise StoreError(f"nvme.paths: {base} is not a directory; choose a directory for swap files") from None
        except OSError as exc:
            raise StoreError(f"nvme.paths: cannot open swap directory {path}: {exc.strerror}; choose a directory "
                             "this user can reach") from None
    for leaf in reversed(missing):
        path = os.path.join(path, leaf)
        try:
            created = False
            try:
                os.mkdir(leaf, 0o700, dir_fd=fd)
                created = True
            except FileExistsError:
                pass  # made meanwhile by someone else: checked below like any directory on the way
            except OSError as exc:
                raise StoreError(f"nvme.paths: cannot create swap directory {path}: {exc.strerror}; choose a "
                                 "writable directory") from None
            child = _open_dir_nofollow(fd, leaf, path, "nvme.paths: ")
        finally:
            os.close(fd)
        fd = child
        if created:
            os.fchmod(fd, 0o700)  # exactly, whatever the umask took away
    return fd


def _open_existing_dir(path: str) -> int:
    """Open directory `path`. Parts above it may be symlinks (the user's choice); `path` itself is followed only
    if the link belongs to this user or root: in a shared directory like /var/tmp anyone may have planted it."""
    try:
        return os.open(path, _NOFOLLOW_DIR)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        try:
            st = os.lstat(path)
        except OSError:
            raise exc from None
        if not stat.S_ISLNK(st.st_mode):
            raise
        if st.st_uid not in (os.geteuid(), 0):
            raise StoreError(
                f"nvme.paths: {path} is a symlink of uid {st.st_uid}, not of this user or root; anyone who can "
                f"write {os.path.dirname(path)} may have planted it. Name the directory itself "
                f"({os.path.realpath(path)}) if it is yours, or remove the link"
            ) from None
    return os.open(path, _DIR_FLAGS)


def _open_dir_nofollow(parent_fd: int, name: str, path: str, key: str = "") -> int:
    """Open directory `name` under `parent_fd`; StoreError naming `path` if it is a symlink or not a directory."""
    try:
        return os.open(name, _NOFOLLOW_DIR, dir_fd=parent_fd)
    except OSError as exc:
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link:
            raise StoreError(f"{key}{path} is a symlink where tiermem made or expects a directory; refusing to "
                             f"follow it. Something may be tampering with {os.path.dirname(path)}: remove the "
                             "link, and use a directory only this user can write") from None
        raise StoreError(f"{key}{path}: cannot open as a directory: {exc.strerror}; remove it or choose another "
                         "directory") from None


def _check_base(base: str, fd: int) -> None:
    """Refuse a base that someone else could change entries of (and so swap our run directory in)."""
    st, euid = os.fstat(fd), os.geteuid()
    if st.st_uid not in (euid, 0):
        raise StoreError(
            f"nvme.paths: {base} belongs to uid {st.st_uid}, not to this user (uid {euid}) or root, so its owner "
            f"could replace the run directory with a symlink; use a directory of your own (mkdir -m 700 DIR) or "
            f"chown it to uid {euid}"
        )
    writers = st.st_mode & stat.S_IWOTH
    if st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid):
        writers |= stat.S_IWGRP
    if writers and not st.st_mode & stat.S_ISVTX:
        who = "other users" if writers & stat.S_IWOTH else f"group {st.st_gid}"
        raise StoreError(
            f"nvme.paths: {base} (mode {stat.S_IMODE(st.st_mode):o}) is writable by {who} without the sticky "
            f"bit, so they could replace the run directory with a symlink; run `chmod go-w {base}` (or "
            f"`chmod +t {base}`), or choose another directory"
        )


def _private_group(gid: int) -> bool:
    """Whether `gid` is this user's own group (user private groups, where umask 002 is the default: the group
    is named after the user and has no other members), so that its write access is this user's alone."""
    try:
        user, group = pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == os.getegid() and group.gr_name == user and set(group.gr_mem) <= {user}


def _make_run_dir(base: str, base_fd: int, name: str) -> tuple[int, bool]:
    """(descriptor, whether we created it) of run directory `name`, made 0700; refused if not this user's."""
    run_dir = os.path.join(base, name)
    created = False
    try:
        os.mkdir(name, 0o700, dir_fd=base_fd)
        created = True
    except FileExistsError:
        pass  # a reopened run (run_name); checked like a new one
    except OSError as exc:
        raise StoreError(f"nvme.paths: cannot create run directory {run_dir}: {exc.strerror}; choose a "
                         "directory this user can write") from None
    fd = _open_dir_nofollow(base_fd, name, run_dir)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise StoreError(f"{run_dir} belongs to uid {st.st_uid}, not to this user; use another run name")
    os.fchmod(fd, 0o700)
    return fd, created


def _open_file(dir_fd: int, name: str, flags: int, run_dir: str) -> int:
    """Open regular file `name` in a run directory, never through a symlink (nor blocking on a FIFO)."""
    path = os.path.join(run_dir, name)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise StoreError(f"{path}: cannot open: {exc.strerror}; remove it or use another run name") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoreError(f"{path} is not a regular file; remove it or use another run name")
    return fd


def _read_owner(run_fd: int) -> dict[str, Any]:
    try:
        fd = _open_file(run_fd, OWNER_FILE, os.O_RDONLY, "")
    except StoreError:
        return {}
    try:
        with os.fdopen(fd, encoding="utf-8") as f:
            data = json.load(f)
            return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _clear_dir(fd: int) -> None:
    """Remove everything in directory `fd`, best effort; a symlink is removed, never followed."""
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    except OSError:
        return
    for name, is_dir in entries:
        try:
            if is_dir:
                sub = os.open(name, _NOFOLLOW_DIR, dir_fd=fd)
                try:
                    _clear_dir(sub)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
        except OSError:
            pass


def _remove_run(base_fd: int, run_fd: int, name: str) -> None:
    _clear_dir(run_fd)
    try:
        os.rmdir(name, dir_fd=base_fd)
    except OSError:
        pass


def _remove_stale_runs(base: str, base_fd: int) -> None:
    """Remove run directories of ours whose owner is gone and which were not kept."""
    try:
        with os.scandir(base_fd) as it:
            names = [e.name for e in it if e.name.startswith(RUN_PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    euid = os.geteuid()
    for name in names:
        try:
            run_fd = os.open(name, _NOFOLLOW_DIR, dir_fd=base_fd)
        except OSError:
            continue
        try:
            if os.fstat(run_fd).st_uid != euid:
                continue  # another user's: not ours to judge
            owner = _read_owner(run_fd)
            if owner.get("keep", True):
                continue  # kept, or not a run directory of tiermem's
            try:
                lock_fd = _open_file(run_fd, LOCK_FILE, os.O_RDWR, "")
            except StoreError:
                continue
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # alive: its owner holds the lock
            else:
                _remove_run(base_fd, run_fd, name)  # removed while we hold its lock
            finally:
                os.close(lock_fd)
        finally:
            os.close(run_fd)
        log.info("removed stale swap run directory %s left by pid %s", os.path.join(base, name),
                 owner.get("pid", "?"))


def _close_dir_fds(dir_fds: list[tuple[int, int]]) -> None:
    for pair in dir_fds:
        for fd in pair:
            try:
                os.close(fd)
            except OSError:
                pass
    dir_fds.clear()


def _cleanup_at_exit(dir_fds: list[tuple[int, int]], name: str, keep: bool) -> None:
    if not keep:
        for base_fd, run_fd in dir_fds:
            _remove_run(base_fd, run_fd, name)
    _close_dir_fds(dir_fds)
