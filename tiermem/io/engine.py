"""The I/O engine interface shared by the io_uring and threads backends (built by tiermem/io/backends.py).

An engine moves bytes between host buffers and IOFiles asynchronously. A request is one or more Pieces of
one buffer, each a range of some file (`read`/`write`: one piece; `read_pieces`/`write_pieces`: several, as
a partition striped over several drives). The engine splits pieces into chunks of at most `block_size`
bytes, keeps at most `queue_depth` chunks in flight, and returns one IOFuture for the request; errors
surface from `IOFuture.wait()` as OSError naming the file and offset of the piece that failed.
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

from tiermem.device import check_host
from tiermem.errors import IOEngineError, ReadPastEndError
from tiermem.io.buffers import as_bytes_view, buffer_address, check_io_size
from tiermem.io.files import IOFile
from tiermem.io.future import IOFuture

DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_QUEUE_DEPTH = 32
OP_READ = 0  # Chunk.op and the engines' op codes; tiermem/io/_native.py maps them to csrc's TM_OP_*
OP_WRITE = 1
RETRYABLE = (errno.EAGAIN, errno.EINTR)  # errno values after which a chunk is simply submitted again


class Piece(NamedTuple):
    """One contiguous range of a request: `length` bytes at `offset` in `file`, at `buf_offset` in the buffer."""

    file: IOFile
    offset: int
    length: int
    buf_offset: int


class Chunk:
    """One part of a piece, at most block_size bytes; requeued with its remainder on a short I/O."""

    __slots__ = ("future", "file", "op", "address", "length", "offset", "view", "view_offset")

    def __init__(self, future: IOFuture, file: IOFile, op: int, address: int, length: int, offset: int,
                 view: memoryview, view_offset: int) -> None:
        self.future = future
        self.file = file
        self.op = op  # OP_READ or OP_WRITE
        self.address = address
        self.length = length
        self.offset = offset
        self.view = view  # the caller's whole buffer, for backends that need a Python buffer
        self.view_offset = view_offset  # where this chunk starts inside `view`

    def advance(self, done: int) -> None:
        """Drop the first `done` bytes after a short transfer, so the rest can be resubmitted."""
        self.address += done
        self.length -= done
        self.offset += done
        self.view_offset += done

    def error(self, err: int) -> OSError:
        return transfer_error(self.file, self.op, err, self.length, self.offset)

    def past_end(self) -> ReadPastEndError:
        return past_end_error(self.file, self.length, self.offset)


def transfer_error(file: IOFile, op: int, err: int, length: int, offset: int) -> OSError:
    """The OSError for a failed piece of a transfer: the verb, the bytes, the offset and the file."""
    verb = "read" if op == OP_READ else "write"
    return OSError(err, f"{verb} of {length} bytes at offset {offset}: {os.strerror(err)}", file.path)


def past_end_error(file: IOFile, length: int, offset: int) -> ReadPastEndError:
    return ReadPastEndError(
        f"{file.path}: read of {length} bytes at offset {offset} goes past the end of the "
        f"file ({file.size()} bytes); the file is shorter than the data expected in it"
    )


class IOEngine(ABC):
    """Asynchronous reads and writes between host buffers and files; a context manager."""

    name: str = "abstract"

    def __init__(self, *, block_size: int = DEFAULT_BLOCK_SIZE, queue_depth: int = DEFAULT_QUEUE_DEPTH) -> None:
        check_io_size("io.block_size", block_size, IOEngineError)
        if queue_depth < 1:
            raise IOEngineError(f"io.queue_depth: expected an integer >= 1, got {queue_depth}")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.closed = False

    def read(self, file: IOFile, buf: Any, offset: int = 0, nbytes: int | None = None) -> IOFuture:
        """Read `nbytes` (default: len(buf)) from `file` at `offset` into the start of `buf`."""
        view = self._view(OP_READ, buf, file.path)
        return self._transfer(OP_READ, view, [Piece(file, offset, len(view) if nbytes is None else nbytes, 0)])

    def write(self, file: IOFile, buf: Any, offset: int = 0, nbytes: int | None = None) -> IOFuture:
        """Write the first `nbytes` (default: all) of `buf` to `file` at `offset`."""
        view = self._view(OP_WRITE, buf, file.path)
        return self._transfer(OP_WRITE, view, [Piece(file, offset, len(view) if nbytes is None else nbytes, 0)])

    def read_pieces(self, buf: Any, pieces: list[Piece]) -> IOFuture:
        """Read every piece into its place in `buf`, as one request with one future."""
        return self._transfer(OP_READ, self._view(OP_READ, buf, _where(pieces)), pieces)

    def write_pieces(self, buf: Any, pieces: list[Piece]) -> IOFuture:
        """Write every piece from its place in `buf`, as one request with one future."""
        return self._transfer(OP_WRITE, self._view(OP_WRITE, buf, _where(pieces)), pieces)

    def register_buffers(self, regions: list[tuple[int, int]]) -> bool:
        """Offer long-lived (address, length) regions for faster I/O; True when the backend uses them."""
        return False

    def _view(self, op: int, buf: Any, where: str) -> memoryview:
        if self.closed:
            raise IOEngineError(f"the {self.name} engine is closed")
        if isinstance(buf, torch.Tensor):
            check_host(f"{where}: I/O buffer", buf)
        view = as_bytes_view(buf)
        if op == OP_READ and view.readonly:
            raise ValueError(f"{where}: cannot read into a read-only buffer")
        return view

    def _transfer(self, op: int, view: memoryview, pieces: list[Piece]) -> IOFuture:
        for p in pieces:
            if p.length < 0 or p.buf_offset < 0 or p.buf_offset + p.length > len(view):
                raise ValueError(f"{p.file.path}: nbytes={p.length} at {p.buf_offset} does not fit the "
                                 f"{len(view)}-byte buffer")
            if p.offset < 0:
                raise ValueError(f"{p.file.path}: offset must be >= 0, got {p.offset}")
        pieces = [p for p in pieces if p.length]
        if not pieces:
            return IOFuture(0, 0)
        return self._start(op, view, buffer_address(view), pieces)

    def _start(self, op: int, view: memoryview, address: int, pieces: list[Piece]) -> IOFuture:
        """Begin a checked request of non-empty pieces. By default: block-size Chunks handed to `_submit`."""
        bs = self.block_size
        future = IOFuture(sum(p.length for p in pieces), sum((p.length + bs - 1) // bs for p in pieces),
                          keepalive=view)
        self._submit([
            Chunk(future, p.file, op, address + p.buf_offset + pos, min(bs, p.length - pos), p.offset + pos, view,
                  p.buf_offset + pos)
            for p in pieces for pos in range(0, p.length, bs)
        ])
        return future

    def _submit(self, chunks: list[Chunk]) -> None:
        """Queue chunks; each one calls `chunk.future._chunk_done(error)` exactly once."""
        raise NotImplementedError

    @abstractmethod
    def close(self) -> None:
        """Finish what is in flight, then release the backend's resources."""

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _where(pieces: list[Piece]) -> str:
    """What a message about the request's buffer names: its first file."""
    return pieces[0].file.path if pieces else "I/O request"
