"""IOFile: an open file for the engines, with O_DIRECT where the filesystem takes it.

# [Note: O_DIRECT and its fallback]
Swap files are opened with O_DIRECT so reads measure the disk and do not fill the page cache. Some
filesystems (tmpfs, some FUSE and overlay setups) refuse O_DIRECT with EINVAL at open; then the file is
opened buffered, a warning says so once per directory, and `IOFile.direct` is False so callers (the
benchmark) can report it. O_DIRECT also needs the offset, length and buffer address aligned to the
logical block size; a request that is not (an odd tail, a caller's unaligned buffer) goes through a
second, buffered descriptor on the same file, which the kernel keeps coherent with the direct one.

# [Note: opening files that others made]
A checkpoint may come from anywhere (a tar archive, a shared folder), and an archive can carry a FIFO, a
device node or a symlink under a file's name. Opening a FIFO with no writer blocks forever (and a thread
blocked in open() or read() holds up asyncio.run and Ctrl-C with it); a symlink to /dev/zero reads until
memory runs out; a symlink can point anywhere. `open_regular` takes only a regular file: it looks at the
entry first (lstat, or stat when links may be followed) and opens nothing else, then opens with O_NONBLOCK
(and O_NOFOLLOW), so a FIFO or device swapped in meanwhile cannot block, and checks with fstat that what it
opened is that same regular file. Callers cap how much they read of what they parse.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading

from tiermem.io.buffers import aligned

log = logging.getLogger(__name__)

_warned_dirs: set[str] = set()
_warned_lock = threading.Lock()


class IOFile:
    """A file opened for engine I/O; a context manager. `direct` tells whether O_DIRECT is in use."""

    def __init__(self, path: str | os.PathLike[str], mode: str = "r", *, direct: bool = True,
                 create_mode: int = 0o600, dir_fd: int | None = None, regular: bool = False,
                 follow_links: bool = True) -> None:
        """With `dir_fd`, only the last component of `path` is opened, relative to that directory descriptor and
        never through a symlink (the swap store's run directories); `path` still names the file in messages.
        With `regular` (mode "r" only), the file is opened by `open_regular` (buffered; `follow_links` as
        there): a file someone else made, such as a checkpoint's shard."""
        if mode not in ("r", "w", "rw"):
            raise ValueError(f"mode must be 'r', 'w' or 'rw', got {mode!r}")
        if regular and (mode != "r" or dir_fd is not None):
            raise ValueError("regular=True opens a file to read it, by path: mode 'r', no dir_fd")
        self.path = os.fspath(path)
        flags = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT, "rw": os.O_RDWR | os.O_CREAT}[mode]
        flags |= os.O_CLOEXEC
        name = self.path
        if dir_fd is not None:
            name = os.path.basename(self.path)
            flags |= os.O_NOFOLLOW
        self.mode = mode
        self.fd = -1  # the descriptor for aligned requests (O_DIRECT when `direct`)
        self.buffered_fd = -1  # the page-cache descriptor for unaligned requests
        self.direct = False  # whether `fd` really is O_DIRECT
        self.fallback_reason: str | None = None  # why O_DIRECT was asked for but is not in use
        if regular:
            self.buffered_fd = self.fd = open_regular(self.path, follow_links=follow_links)
            return
        if direct:
            try:
                self.fd = os.open(name, flags | os.O_DIRECT, create_mode, dir_fd=dir_fd)
                self.direct = True
            except OSError as exc:
                if exc.errno != 22:  # EINVAL: the filesystem refuses O_DIRECT; anything else is real
                    raise
                self.fallback_reason = f"{fs_of(self.path)} refuses O_DIRECT"
                _warn_once(self.path, self.fallback_reason)
        try:
            self.buffered_fd = os.open(name, flags, create_mode, dir_fd=dir_fd)
        except BaseException:
            self.close()  # the direct descriptor, if that one opened (a disk that failed in between)
            raise
        if self.fd < 0:
            self.fd = self.buffered_fd

    def fd_for(self, address: int, offset: int, length: int) -> int:
        """The descriptor that can serve this request: the direct one only when it is all aligned."""
        if self.direct and aligned(address, offset, length):
            return self.fd
        return self.buffered_fd

    def size(self) -> int:
        return os.fstat(self.buffered_fd).st_size

    def allocate(self, offset: int, length: int) -> None:
        """Reserve disk blocks for [offset, offset+length) so writes cannot hit ENOSPC later."""
        try:
            os.posix_fallocate(self.buffered_fd, offset, length)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot reserve {length} bytes at offset {offset}: {exc.strerror}",
                          self.path) from None

    def close(self) -> None:
        for fd in {self.fd, self.buffered_fd}:
            if fd >= 0:
                os.close(fd)
        self.fd = self.buffered_fd = -1

    def __enter__(self) -> IOFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"IOFile({self.path!r}, {self.mode!r}, direct={self.direct})"


_NOT_REGULAR = ((stat.S_ISLNK, errno.ELOOP, "a symbolic link"), (stat.S_ISDIR, errno.EISDIR, "a directory"),
                (stat.S_ISFIFO, errno.EINVAL, "a FIFO"), (stat.S_ISCHR, errno.EINVAL, "a character device"),
                (stat.S_ISBLK, errno.EINVAL, "a block device"), (stat.S_ISSOCK, errno.EINVAL, "a socket"))


def open_regular(path: str | os.PathLike[str], *, follow_links: bool = False) -> int:
    """A read-only descriptor of the regular file `path` (see [Note: opening files that others made]). Anything
    else (a directory, FIFO, device or socket, or without `follow_links` a symbolic link) raises OSError(errno,
    "a FIFO, not a regular file", path) without being opened; nothing here blocks."""
    path = os.fspath(path)
    before = os.stat(path, follow_symlinks=follow_links)
    refuse_unless_regular(before, path)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:  # made a symlink after the lstat
            raise OSError(errno.ELOOP, "a symbolic link, not a regular file", path) from None
        raise
    try:
        now = os.fstat(fd)
        refuse_unless_regular(now, path)
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise OSError(errno.ESTALE, "replaced by another file while it was being opened", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def refuse_unless_regular(st: os.stat_result, path: str) -> None:
    if stat.S_ISREG(st.st_mode):
        return
    for test, code, kind in _NOT_REGULAR:
        if test(st.st_mode):
            raise OSError(code, f"{kind}, not a regular file", path)
    raise OSError(errno.EINVAL, f"not a regular file (mode {st.st_mode:o})", path)


def fs_of(path: str) -> str:
    """The filesystem type holding `path`, from /proc/self/mountinfo ('this filesystem' if unknown)."""
    best, fstype = "", "this filesystem"
    target = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount_point = left.split()[4]
                if (target == mount_point or target.startswith(mount_point.rstrip("/") + "/")) and len(
                    mount_point
                ) >= len(best):
                    best, fstype = mount_point, f"the {right.split()[0]} filesystem at {mount_point}"
    except OSError:
        pass
    return fstype


def _warn_once(path: str, reason: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    with _warned_lock:
        if directory in _warned_dirs:
            return
        _warned_dirs.add(directory)
    log.warning("%s: %s; using buffered I/O there (reads may be served by the page cache)", directory, reason)
